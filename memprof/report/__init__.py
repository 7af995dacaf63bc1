"""Renderers: console, JSON and plots of the analysis findings. They never analyse."""
