"""Registries of plain functions: advantage estimators, policy losses, reward combiners."""
