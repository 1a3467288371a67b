import sys

from sgl_piecewise.cli import main

sys.exit(main())
