"""The study: profiles expand into points, an executor (serial or Ray) computes each through a runner (a kvlib policy
or an outside backend) into the results store, and the book executes the notebooks over those results."""

from kvlib.study.experiments import experiment
from kvlib.study.run import load, load_profile, run_study, stored

__all__ = ["experiment", "load", "load_profile", "run_study", "stored"]
