"""Example user rewards (``pkg.module:factory``, docs/rewards.md): GenEval-style detection and OCR, served by
``python -m tools.rewards serve`` and used by a run as ``remote`` rewards. Not part of the core reward registry:
each wraps a third-party model behind the generic user-reward path."""
