"""Adapters to kernels that other libraries maintain, each beside tapelm's own reference path."""
