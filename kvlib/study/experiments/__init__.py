"""One module per experiment, each with `run_point(point) -> list[dict]`; see kvlib.study."""
