"""Every use of a private torch or Triton API, one module per concern.

The rest of the package reaches torch's and Triton's internals only through
these modules. Each one's docstring says what it bypasses and why (the
figure it pays on), which versions it was written against, and what it does
where the installed version lacks what it needs: each checks that at import
and sets a module-level ``AVAILABLE`` (False with the reason beside it), and
its callers then take a public path. A test forces every such path
(``tests/test_internals_torch.py`` for the torch ones) and checks that every
module reports ``AVAILABLE`` on the installed versions, so an upgrade that
breaks one shows up as a failing test, not as a slower or wrong step.

torch (written against 2.11-2.13; ``UNAVAILABLE_REASON``):

* ``storage_alias``: a tensor over another's memory that does not keep it
  allocated (piecewise graphs' outputs, the breakable runner's tensors);
  fallback: an ordinary alias, which keeps the memory allocated;
* ``cuda_graph_pool``: cuBLAS workspaces freed before a capture, so the
  capture allocates them in its pool; a failed capture's pool closed;
  fallback: both skipped (a logged warning for the workspaces);
* ``size_oblivious``: Dynamo's size-oblivious tracing of a backed token
  axis, and the shape environment read to drop the guards that only bound
  it (``compile/token_guards.py``); fallback: the token axis marked unbacked;
* ``dynamo_trace``: the source files a trace read and its side effects
  (``compile/precompiled.py``); fallback: nothing saved, every call through
  Dynamo;
* ``dynamo_backend``: what a custom Dynamo backend needs from Dynamo (the
  trace's fake mode, another backend by name, the graph-break exception);
  no fallback: a clear error;
* ``inductor``: Inductor's entry points (``compile_fx``,
  ``standalone_compile``, custom post-grad passes); imported only where a
  piece compiles with Inductor (importing Inductor takes seconds); no
  fallback: a clear error (``piece_compiler='eager'`` needs none of it).

Triton (written against Triton 3.4-3.6):

* ``triton_jit``: whether a kernel runs compiled or under the interpreter;
* ``triton_launch``: the launcher that skips Triton's per-call Python.

Others:

* ``fake_tensor``: whether a tensor is one of torch.compile's fake tensors
  (a plain ``meta`` call to the attention op is checked against the KV
  pool, a traced one is not); fallback: every tensor counts as fake.

The layers contract (``.importlinter``) lets these modules import only
``sgl_piecewise.errors`` of this package; importing this package imports
none of them.
"""
