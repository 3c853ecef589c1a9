"""Where teacher log-probs come from: one small interface (`TeacherScorer`), one file per source."""

from .base import TeacherScorer, TeacherScores
from .local import LocalTeacher

__all__ = ["LocalTeacher", "TeacherScorer", "TeacherScores"]
