"""Reading results: tables, findings, figures and the chooser, pure functions of the results frames that the
notebooks and `kvlib choose` call."""
