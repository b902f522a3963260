"""The report is one module or package a chapter (kvlib.report.<experiment>): each experiment's declared lead comes
from its own chapter's module, so that a chapter's sentences, tables and figures are found where its name says, and
a new experiment's chapter goes beside the others rather than into a module of one kind of output."""

import importlib

from kvlib.study.experiments import REGISTRY


def test_each_experiment_opens_from_its_own_chapter_module():
    for name, declared in REGISTRY.items():
        assert declared.lead.__module__.split(".")[:3] == ["kvlib", "report", name], (name, declared.lead.__module__)
        importlib.import_module(f"kvlib.report.{name}")  # a module or a package of the chapter's name
