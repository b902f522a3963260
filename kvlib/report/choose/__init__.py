"""Which policy when: the chooser (`kvlib choose`), read from a profile's results. kvlib.report.choose.workload
answers one workload; .evidence weighs accuracy; .regimes runs it over regimes; .serving answers at a request rate."""

from kvlib.report.choose.evidence import CANNOT_TELL, RULED_OUT, WITHIN, AccuracyEvidence, accuracy_evidence
from kvlib.report.choose.projected import ProjectedChoice, choose_projected
from kvlib.report.choose.regimes import by_question, error_rate_statement, largest_workload, regimes, tight_memory_gb
from kvlib.report.choose.serving import ServingChoice, choose_serving
from kvlib.report.choose.workload import Choice, Estimate, choose, read_at

__all__ = [
           "CANNOT_TELL",
           "RULED_OUT",
           "WITHIN",
           "AccuracyEvidence",
           "Choice",
           "Estimate",
           "ProjectedChoice",
           "ServingChoice",
           "accuracy_evidence",
           "by_question",
           "choose",
           "choose_projected",
           "choose_serving",
           "error_rate_statement",
           "largest_workload",
           "read_at",
           "regimes",
           "tight_memory_gb",
]
