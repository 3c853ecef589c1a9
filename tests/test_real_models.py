"""Real pretrained models, with their real tokenizers and chat templates: SmolLM2-135M-Instruct trained for 2 steps,
and the tokenizer check on the real Qwen2.5-Coder pair and on SmolLM2 against Qwen.

The models are named by Hub id and read through `resolve_model`: `make test` builds them once with
`../shared/real-models.sh` (a cache in ~/.cache/real-models) and points OPD_MODELS_DIR at them.
"""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from trl_opd.models_dir import resolve_model
from trl_opd.tools import cli, recipe

QWEN_05B, QWEN_15B = "Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-1.5B-Instruct"
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
needs_real_models = pytest.mark.skipif(
    not all(Path(resolve_model(name)).is_dir() for name in (QWEN_05B, QWEN_15B, SMOLLM2)),
    reason="the real models are not local: set OPD_MODELS_DIR to a directory that holds them (`make real-models` "
           "builds them with ../shared/real-models.sh and prints the export)")
ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def code_task(tmp_path_factory):
    from trl_opd.envs.code_output import make_code_task

    return make_code_task(tmp_path_factory.mktemp("code_task"), train=16, heldout=8)


def _train_smollm2(code_task, output_dir, *extra):
    # by Hub id, as a recipe names it: build_trainer reads it from OPD_MODELS_DIR
    args = recipe.make_parser().parse_args_and_config([
        "--config", str(ROOT / "recipes" / "smoke_cpu.yaml"), "--model_name_or_path", SMOLLM2,
        "--teacher_model_name_or_path", SMOLLM2, "--dataset_name", str(code_task / "train.jsonl"),
        "--output_dir", str(output_dir), "--max_steps", "2", "--logging_steps", "1", "--lora_r", "8",
        "--lora_alpha", "16", "--per_device_train_batch_size", "4", "--max_completion_length", "16", *extra,
    ])
    trainer = cli.train(*args)
    return [entry for entry in trainer.state.log_history if "opd/reverse_kl" in entry]


@needs_real_models
def test_smollm2_distils_from_itself_with_zero_kl_until_the_teacher_gets_a_system_prompt(code_task, tmp_path):
    # the teacher is the student's own checkpoint: reading the same rendered prompt, its log-probs are the student's
    # to round-off, so both the sampled and the exact full-vocabulary KL are 0 on the first step
    same = _train_smollm2(code_task, tmp_path / "same")
    assert [entry["step"] for entry in same] == [1, 2]
    assert all(math.isfinite(value) for entry in same for value in entry.values())
    assert abs(same[0]["opd/reverse_kl"]) < 1e-4
    assert abs(same[0]["opd/reverse_kl_dense"]) < 1e-4

    # a teacher-only system prompt replaces SmolLM2's default system message in the teacher's rendering only, so the
    # teacher scores the same tokens in another context: a KL well above round-off
    prompted = _train_smollm2(code_task, tmp_path / "prompted", "--teacher_system_prompt",
                              "You are a Python interpreter. Answer with the exact printed output and nothing else.")
    assert all(math.isfinite(value) for entry in prompted for value in entry.values())
    assert prompted[0]["opd/reverse_kl_dense"] > 1e-2


@needs_real_models
def test_tokenizer_check_passes_for_the_qwen_pair_and_refuses_smollm2_against_qwen():
    from transformers import AutoTokenizer

    from trl_opd.checks import check_tokenizers_compatible

    student, teacher, smollm2 = (AutoTokenizer.from_pretrained(resolve_model(name))
                                 for name in (QWEN_05B, QWEN_15B, SMOLLM2))
    check_tokenizers_compatible(student, teacher, student_name="0.5B", teacher_name="1.5B")
    with pytest.raises(ValueError, match=r"tokenizers differ: token id 0 is '<\|endoftext\|>' for the student and "
                                         r"'!' for the teacher"):
        check_tokenizers_compatible(smollm2, student, student_name="SmolLM2", teacher_name="Qwen")


@needs_real_models
def test_a_qwen_teacher_reads_a_smollm2_students_tool_result_through_qwens_template():
    # SmolLM2 writes a tool result as a `tool` turn; Qwen2.5's template wraps it in a user turn's <tool_response>:
    # that is what the teacher reads between the student's turns, while the turns themselves are the sampled text
    from transformers import AutoTokenizer

    from trl_opd.teachers.cross import CrossTokenizerTeacher

    student, teacher = (AutoTokenizer.from_pretrained(resolve_model(name)) for name in (SMOLLM2, QWEN_05B))
    cross = CrossTokenizerTeacher(None, student_tokenizer=student, teacher_tokenizer=teacher,
                                  stop_ids=[student.eos_token_id])
    prompt = [{"role": "user", "content": "What is (3 + 5) * 7?"}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 5}}</tool_call>'
    messages = [{"role": "assistant", "content": call}, {"role": "tool", "name": "add", "content": "8"},
                {"role": "assistant", "content": "The answer is 56."}]
    turns = [student(text, add_special_tokens=False)["input_ids"] + [student.eos_token_id]
             for text in (call, "The answer is 56.")]
    between = student("\n<|im_start|>tool\n8<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    ids = turns[0] + between + turns[1]
    action = [1] * len(turns[0]) + [0] * len(between) + [1] * len(turns[1])
    teacher_ids, teacher_chunk, student_chunk = cross.translate(ids, action, cross.row_observations(
        prompt, messages, action))
    context = teacher.decode([token for token, chunk in zip(teacher_ids, teacher_chunk, strict=True) if chunk < 0])
    assert context == "\n<|im_start|>user\n<tool_response>\n8\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert teacher.decode(teacher_ids) == f"{call}<|im_end|>{context}The answer is 56.<|im_end|>"
    assert all((chunk >= 0) == bool(flag) for chunk, flag in zip(student_chunk, action, strict=True))


def test_code_task_answers_are_what_python_prints_and_no_heldout_program_is_trained_on(tmp_path):
    # runs without the real models: the task itself
    import contextlib
    import io
    import json

    from trl_opd.envs.code_output import make_code_task, printed_output_reward

    directory = make_code_task(tmp_path, train=300, heldout=90)
    train, heldout = ([json.loads(line) for line in open(directory / f"{name}.jsonl")] for name in ("train", "heldout"))
    assert (len(train), len(heldout)) == (300, 90)

    def program(row):
        return row["prompt"][0]["content"].split("```python\n")[1].split("\n```")[0]

    for row in heldout[:20]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(program(row), {})
        assert out.getvalue() == row["solution"] + "\n"
    assert len({program(row) for row in heldout}) == 90
    assert not {program(row) for row in train} & {program(row) for row in heldout}
    answer = heldout[0]["solution"]
    completions = [answer, f"`{answer}`", f"```plaintext\n{answer}\n```", f"'{answer}'", f"{answer}.", "", answer[:-1]]
    assert printed_output_reward([[{"role": "assistant", "content": c}] for c in completions],
                                 [answer] * len(completions)) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]



def test_the_agent_grade_reads_the_reply_or_its_json_answer_field_and_nothing_else():
    # what Qwen2.5-Coder 1.5B replies after a run_python call (benchmarks/results/code_agent_teacher.json)
    from trl_opd.envs.code_output import printed_output_reward, stated_output_reward

    restated = '```json\n{"name": "run_python", "arguments": {"code": "print(len(\'banana\'))"}, "return": "%s"}\n```'
    replies = ["6", "`6`", restated % "6\\n", '{"output": "6"}', '{"result": 6}', '{"return": "7"}',
               '{"name": "run_python", "arguments": {"code": "print(6)"}}', '{"answer": "6"}', '{"result": true}',
               "The output is 6.", '["6"]', ""]
    completions = [[{"role": "assistant", "content": reply}] for reply in replies]
    assert stated_output_reward(completions, ["6"] * len(replies)) == [1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0]
    assert printed_output_reward(completions, ["6"] * len(replies)) == [1, 1] + [0] * 10  # the strict grade
    # an unanswered tool call (content "" and tool_calls) states nothing
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    assert stated_output_reward([[call]], ["6"]) == [0.0]

@needs_real_models
def test_tool_calls_of_both_qwen_templates_are_parsed_and_untagged_ones_on_request():
    # TRL knows Qwen2.5's template by its text and the 1.5B's differs in one line, so its tool loop would parse no
    # call of the 1.5B; and both models write their call as bare or fenced JSON, without the template's tags
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, parse_response

    from trl_opd.trainer.multiturn import set_tool_call_parser

    call = {"type": "function", "function": {"name": "run_python", "arguments": {"code": "print(1)"}}}
    tagged = '<tool_call>\n{"name": "run_python", "arguments": {"code": "print(1)"}}\n</tool_call><|im_end|>'
    fenced = '```json\n{\n  "name": "run_python",\n  "arguments": {"code": "print(1)"}\n}\n```<|im_end|>'
    bare = '{"name": "run_python", "arguments": {"code": "print(1)"}}<|im_end|>'
    answers = ['{"name": "run_python", "arguments": {"code": "print(1)"}, "return": "1"}<|im_end|>',  # extra key
               'Run {"name": "run_python", "arguments": {}}<|im_end|>', "1<|im_end|>"]  # prose; a plain answer
    for name in (QWEN_05B, QWEN_15B):
        untouched = AutoTokenizer.from_pretrained(resolve_model(name))
        if name == QWEN_15B:
            with pytest.raises(ValueError, match="Unrecognized chat template"):
                add_response_schema(untouched)
        for untagged in (False, True):
            tokenizer = AutoTokenizer.from_pretrained(resolve_model(name))
            set_tool_call_parser(tokenizer, SimpleNamespace(untagged_tool_calls=untagged), multi_turn=True)

            def parse(text, tokenizer=tokenizer):  # as GRPO's tool loop calls it, after the prompt's ids
                prefix = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tokenize=True,
                                                       add_generation_prompt=True, return_dict=False)
                return parse_response(tokenizer, tokenizer(text, add_special_tokens=False)["input_ids"],
                                      prefix=prefix)

            assert parse(tagged)["tool_calls"] == [call]
            for text in (fenced, bare):
                assert parse(text).get("tool_calls") == ([call] if untagged else None), (name, text)
            assert all(not parse(text).get("tool_calls") and parse(text)["content"] for text in answers)
    with pytest.raises(ValueError, match="untagged_tool_calls parses tool calls for GRPO's tool loop, and this run "
                                         "has none"):
        set_tool_call_parser(untouched, SimpleNamespace(untagged_tool_calls=True), multi_turn=False)
