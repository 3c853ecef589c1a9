"""Start-up checks that fail before any model weights are loaded: data, tokenizers, vocabulary sizes."""

from __future__ import annotations


def check_prompt_dataset(dataset, *, name: str = "train_dataset", teacher_prompt_column: str | None = None) -> None:
    """A prompt dataset must be non-empty and have a `prompt` column (string or chat messages), and the teacher's
    prompt column if one is configured."""
    if dataset is None:
        return
    columns = getattr(dataset, "column_names", None)
    if columns is not None and teacher_prompt_column and teacher_prompt_column not in columns:
        raise ValueError(
            f"{name} has no {teacher_prompt_column!r} column (columns: {columns}), which teacher_prompt_column names "
            "as the prompt the teacher sees. Add it, or unset teacher_prompt_column."
        )
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{name} has no 'prompt' column (columns: {columns}). OPDTrainer reads prompts from 'prompt', as a string "
            "or a list of chat messages. Rename your column, e.g. `dataset.rename_column('question', 'prompt')`, or "
            "set `prompt_column: question` in a recipe."
        )
    try:
        size = len(dataset)
    except TypeError:  # an IterableDataset has no length; an empty stream surfaces when training starts
        return
    if size == 0:
        raise ValueError(f"{name} is empty: there are no prompts to sample completions for.")


def check_tokenizers_compatible(student_tokenizer, teacher_tokenizer, *, student_name: str, teacher_name: str) -> None:
    """The teacher must read every token id the student can write as the same token, with the same bos/eos.

    The teacher may know extra tokens (a larger vocabulary); it may not map any student id to another string.
    Padding tokens may differ: padding is never scored.
    """
    student_vocab = {index: token for token, index in student_tokenizer.get_vocab().items()}
    teacher_vocab = {index: token for token, index in teacher_tokenizer.get_vocab().items()}
    for index in sorted(student_vocab):
        if teacher_vocab.get(index) != student_vocab[index]:
            raise ValueError(
                f"The student ({student_name}) and teacher ({teacher_name}) tokenizers differ: token id {index} is "
                f"{student_vocab[index]!r} for the student and {teacher_vocab.get(index)!r} for the teacher. The "
                "teacher scores the student's token ids as they are, so both must share one vocabulary (e.g. two "
                "sizes of the same model family)."
            )
    for role in ("bos_token_id", "eos_token_id"):
        student_id, teacher_id = getattr(student_tokenizer, role), getattr(teacher_tokenizer, role)
        if student_id != teacher_id:
            raise ValueError(
                f"The student ({student_name}) and teacher ({teacher_name}) disagree on {role}: {student_id} vs "
                f"{teacher_id}. Use a teacher from the student's model family, or align the special tokens."
            )


def check_vocab_sizes(*, student_vocab_size: int, teacher_vocab_size: int, student_name: str, teacher_name: str):
    """The teacher's output layer must cover every id the student's output layer can sample."""
    if teacher_vocab_size < student_vocab_size:
        raise ValueError(
            f"The teacher ({teacher_name}) outputs {teacher_vocab_size} logits per token but the student "
            f"({student_name}) can sample {student_vocab_size} token ids, so some sampled tokens could not be scored. "
            "Use a teacher whose vocabulary is at least the student's."
        )
