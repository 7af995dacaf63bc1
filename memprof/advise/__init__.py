"""Advise: what to change so that a run fits a memory budget (``memprof suggest``).

``budget`` reads the budget; ``source`` reads the run to advise on; ``peak`` models the
peak's composition and how a remedy changes it; ``remedies`` is the catalogue (each with
its seed document, cost, savings model, assumptions and code snippet); ``plan`` picks the
cheapest combination that fits; ``rerun`` re-runs the recorded command with a remedy
applied (``--verify``, ``--fit-batch``); ``render`` prints and serialises the advice.
"""
