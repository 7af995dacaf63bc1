"""The memory regression gate: compare a run's report with a baseline and give a verdict."""
