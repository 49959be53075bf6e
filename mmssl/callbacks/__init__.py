"""Evaluation and visualisation callbacks; each sees a model only through its public stages."""
