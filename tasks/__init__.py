"""Thin Prefect tasks around the cifar/ stages."""
