"""kvlib: KV-cache management policies (full, paged, H2O, InfiniGen) in one generation engine."""

__version__ = "0.1.0"
