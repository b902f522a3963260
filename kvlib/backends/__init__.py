"""Outside inference engines, run on the same workloads as kvlib's policies and returning the same RunResult
(kvlib.study.runners names them next to the policies)."""
