"""What moetune reads from vLLM, below the rules and kernels: the versions it supports and
what differs between them (``versions``), the experts classes it hooks (``classes``), vLLM's
tuned Triton configs and default heuristic (``configs``) and its CPU MoE pieces (``cpu``).

With ``moetune.serving`` (the plugin on top), the only modules that import vLLM.
"""
