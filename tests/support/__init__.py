"""Helpers shared by test packages (real local servers, fixtures' building blocks)."""
