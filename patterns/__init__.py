"""One matcher module per op family (installed as tk_inductor.patterns); see tk_inductor/rewrite.py."""
