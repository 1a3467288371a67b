"""Every use of a private torch or Triton API, one module per concern
(``tests/test_private_api_rule.py`` keeps the rest of the package out of
them). Each module's docstring names what it bypasses, why, the versions it
was written against and its fallback; each sets ``AVAILABLE`` at import
(False with ``UNAVAILABLE_REASON``), its callers then take a public path,
and the tests force every fallback. They import only ``sgl_piecewise.errors``.
"""
