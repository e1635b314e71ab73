"""How conversations become token ids: the chat template's rendering of a prompt, the template's tokens between
one answer and the next user turn, an answer's text as ids. One layout for answers generated here, at an endpoint,
or taken from the dataset, so their stores hold the same ids for the same answers."""
from __future__ import annotations

import hashlib

ANSWER = "<draftheads answer>"  # stands for an answer inside a rendered chat template


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template's rendering with the generation prompt, as the engine and `draftheads serve` tokenize it."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def stop_token_of(tokenizer, eos_token_ids) -> int | None:
    """The token that closes an assistant turn in the chat template, when it is one the target stops on."""
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": ANSWER}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    closing = tokenizer.encode(text[text.rindex(ANSWER) + len(ANSWER):], add_special_tokens=False)
    return closing[0] if closing and closing[0] in eos_token_ids else None


def text_ids(tokenizer, text: str) -> list[int] | None:
    """`text` tokenized, or None when those tokens do not decode back to it."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids if tokenizer.decode(ids, skip_special_tokens=True) == text else None


def user_turns(messages: list[dict], turns: str) -> list[list[dict]]:
    """The messages that lead to each answer: one user turn with any non-assistant messages before it.
    The dataset's own answers are dropped; with turns="first" only the first user turn is kept."""
    found, current = [], []
    for message in messages:
        if message["role"] == "assistant":
            continue
        current.append(message)
        if message["role"] == "user":
            found.append(current)
            current = []
    if not found:
        raise ValueError("the conversation has no user turn")
    return found[:1] if turns == "first" else found


def template_ids_after_answer(tokenizer, history: list[dict], following: list[dict], stop_token: int | None) -> list[int]:
    """The chat template's token ids from the end of an answer to the start of the next one: the answer's
    closing, the `following` messages (ending with a user turn) and the generation prompt.

    history: the messages up to the answer. stop_token: the token the answer stopped on, when it did; the
    target generated it in place of the template's closing text, so that text is not repeated."""
    messages = history + [{"role": "assistant", "content": ANSWER}] + following
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text[text.rindex(ANSWER) + len(ANSWER):]
    if stop_token is not None:
        stop = tokenizer.decode([stop_token])
        if text.startswith(stop):
            text = text[len(stop):]
    return tokenizer.encode(text, add_special_tokens=False)


def request_seed(seed: int, conversation_id: str, turn: int) -> int:
    """A request's own seed, so an answer is the same whichever order or run it is generated in."""
    digest = hashlib.sha256(f"{seed}/{conversation_id}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
