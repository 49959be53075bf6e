"""LightningModules and their building blocks."""
