"""Where teacher log-probs come from: one small interface (`TeacherScorer`), one file per source."""

from .base import TeacherScorer, TeacherScores
from .local import LocalTeacher
from .reference import ReferenceTeacher
from .routed import RoutedTeacher
from .vllm_server import TeacherServerError, VLLMServerTeacher

__all__ = [
    "LocalTeacher",
    "ReferenceTeacher",
    "RoutedTeacher",
    "TeacherScorer",
    "TeacherScores",
    "TeacherServerError",
    "VLLMServerTeacher",
]
