"""`kvlib study`: a profile's experiments (resumable), serially or on a Ray cluster, then its notebooks and book."""

from __future__ import annotations

from kvlib.errors import UserError


def add_parser(sub) -> None:
    study = sub.add_parser("study", help="run a profile's experiments (resumable) and execute the notebooks")
    study.add_argument("--profile", default="embedded",
                       help="a profile's name (params/<name>.yaml) or a path to your own YAML file (its results go "
                            "to results/<file name without .yaml>/)")
    study.add_argument("--experiments", nargs="+", default=None, help="a subset of the profile's experiments")
    study.add_argument("--force", action="store_true", help="recompute points already in results/")
    study.add_argument("--build", action="store_true", help="then build the HTML book (book/_build/html)")
    study.add_argument("--publish", action="store_true",
                       help="then publish the results and the executed chapters as the profile's reference book "
                            "(reference/<profile>/) and, for the book's profile, README's verdict table")
    study.add_argument("--from-reference", action="store_true",
                       help="start from the published reference's rows (reference/<profile>/): they go to "
                            "results/<profile>/ and only what they lack is computed; with --publish, the reference's "
                            "chapters executed again by this checkout's code from the same rows")
    study.add_argument("--policies", nargs="+", default=None,
                       help="only these policies / backends (e.g. every kvlib policy where vLLM is not installed); "
                            "the book then shows what is stored and says what is missing")
    study.add_argument("--compute-only", action="store_true",
                       help="store the results only, no notebooks (a GPU machine without the book's packages)")
    study.add_argument("--executor", choices=["serial", "ray"], default="serial",
                       help="serial: every point in this process; ray: on a Ray cluster (the `distributed` extra)")
    study.add_argument("--workers", type=int, default=None,
                       help="processes of one thread that share an untimed experiment's units (accuracy, "
                            "retention; timed ones always run alone); default: a core each; at most as many as the memory holds for "
                            "the largest model the units load")
    study.add_argument("--address", default=None,
                       help="with --executor ray: the cluster to join (`ray start --head` prints it); default: start "
                            "Ray on this machine")
    study.add_argument("--gpus-per-point", type=float, default=0, help="with --executor ray: GPUs each worker holds")
    study.add_argument("--cpus-per-point", type=float, default=1, help="with --executor ray: CPUs each worker holds")
    study.add_argument("--device", default=None,
                       help="run on this device (cpu, cuda, ...) instead of the profile's; with --compute-only, its "
                            "results go to results/<profile>-<device>/")
    study.add_argument("--toy", action="store_true",
                       help="the profile at its own toy size (its `toy:` values): the same policies and code paths in "
                            "seconds; with --compute-only, its results go to results/<profile>-toy[-<device>]/")


def handle(args) -> int:
    from kvlib.study import run_study
    from kvlib.study.executor import untimed_workers

    executor = None
    if args.executor == "ray":
        from kvlib.study.ray_executor import RayExecutor

        executor = RayExecutor(args.address, gpus_per_point=args.gpus_per_point, cpus_per_point=args.cpus_per_point)
    elif args.address is not None or args.gpus_per_point or args.cpus_per_point != 1:
        raise UserError("--address, --gpus-per-point and --cpus-per-point need --executor ray")
    run_study(args.profile, args.experiments, force=args.force, build=args.build, policies=args.policies,
              notebooks=not args.compute_only, executor=executor, device=args.device, toy=args.toy,
              publish=args.publish, workers=args.workers or untimed_workers(), from_reference=args.from_reference)
    return 0
