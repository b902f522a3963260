"""Projections from counted work to hardware the book does not run on: a lower bound on time from a machine's
limits (bound), a GPU step from aiconfigurator-core's measured kernels (gpu_kernels, optional), and the paper's
settings at Llama-3.1-8B's published shape (paper_scale). Every figure they give is labelled projected."""
