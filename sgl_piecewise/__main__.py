import sys

from sgl_piecewise.engine.cli import main

sys.exit(main())
