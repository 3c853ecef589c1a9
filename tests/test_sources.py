"""What each teacher source declares it supports (`SUPPORT` beside its scorer, `teachers/sources.py`), and the checks
that read those declarations instead of matching source names."""

import pytest

from trl_opd import OPDConfig, OPDTrainer
from trl_opd.teachers.sources import SOURCES, source_support
from trl_opd.trainer.hub import describe_teacher

SERVED = "http://127.0.0.1:9"
# one value of each source's choosing option
CHOICES = {"local": "tiny/teacher", "served": [SERVED], "reference": True, "self": "initial",
           "routed": {"math": "tiny/teacher", "code": SERVED}}


def _config(tmp_path, **options):
    return OPDConfig(output_dir=str(tmp_path), bf16=False, report_to="none", **options)


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_each_declared_source_is_the_one_its_option_chooses(tmp_path, name):
    support = SOURCES[name]
    (option,) = support.chooses
    args = _config(tmp_path, **{option: CHOICES[name]})
    assert args.teacher_source() == name and source_support(args).name == name
    assert "sampled" in support.estimators  # every source scores the sampled tokens
    assert describe_teacher(args) == support.describe(args) and "None" not in describe_teacher(args)


def test_a_server_url_given_as_the_teacher_model_is_the_served_source_on_the_card(tmp_path):
    args = _config(tmp_path, teacher_model_name_or_path="http://user:secret@127.0.0.1:9")
    assert source_support(args).name == "served"
    assert describe_teacher(args) == "served by vLLM at http://***@127.0.0.1:9"


def test_routed_teachers_support_together_what_each_of_them_does(tmp_path):
    mixed = source_support(_config(tmp_path, teachers={"math": "tiny/teacher", "code": SERVED}))
    served = source_support(_config(tmp_path, teachers={"math": SERVED, "code": f"{SERVED}1"}))
    assert not mixed.off_trainer and mixed.not_loaded is None  # the local one runs here, and is loaded from a path
    assert served.off_trainer and "every routed teacher is served" in served.not_loaded
    with pytest.raises(ValueError, match="routed teachers with a local model .* runs on the trainer's own devices"):
        _config(tmp_path, teachers={"math": "tiny/teacher", "code": SERVED}, opd_overlap_scoring=True)
    _config(tmp_path, teachers={"math": SERVED, "code": f"{SERVED}1"}, opd_overlap_scoring=True)  # accepted


@pytest.mark.parametrize("name, refused", [
    ("reference", dict(opd_estimator="topk")),
    ("reference", dict(teacher_tokenizer_mode="cross")),
    ("self", dict(teacher_tokenizer_mode="cross")),
    ("self", dict(opd_overlap_scoring=True)),
    ("local", dict(opd_overlap_scoring=True)),
])
def test_an_option_a_source_declares_it_cannot_honour_is_refused_naming_the_source(tmp_path, name, refused):
    support = SOURCES[name]
    with pytest.raises(ValueError, match=support.option.split(" (")[0]):
        _config(tmp_path, **{support.chooses[0]: CHOICES[name]}, **refused)


@pytest.mark.parametrize("source", [dict(ref_as_teacher=True), dict(student_as_teacher="initial",
                                                                     teacher_system_prompt="Think.")])
def test_teacher_temperature_is_refused_where_the_source_scores_at_the_students_temperature(tiny, prompts, tmp_path,
                                                                                            source):
    args = _config(tmp_path, teacher_temperature=0.5, per_device_train_batch_size=4, num_generations=1,
                   max_completion_length=8, max_steps=1, opd_estimator="sampled", **source)
    with pytest.raises(ValueError, match="teacher_temperature does not apply to (ref_as_teacher|student_as_teacher)"):
        OPDTrainer(model=str(tiny / "student"), args=args, train_dataset=prompts)
