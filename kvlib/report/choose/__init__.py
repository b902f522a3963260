"""Which policy when: the chooser (`kvlib choose`), read from a profile's results. kvlib.report.choose.workload
answers one workload; .evidence weighs accuracy; .regimes runs it over regimes; .serving answers at a request rate."""
