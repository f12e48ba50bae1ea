"""``chat_template.jinja`` is read only as a regular file of the tokenizer's directory: a link out
of it, a FIFO or a directory is refused in one line (a Hugging Face cache snapshot, whose files
link to the repository's ``blobs``, still reads)."""

import json
import os

import pytest

pytest.importorskip("tokenizers")

from megatron_fastpath.hf.tokenizer import ChatTokenizer, TokenizerError

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "a"}]


def tokenizer_dir(path):
    """A minimal tokenizer directory: tokenizer.json, tokenizer_config.json without a template."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    os.makedirs(path, exist_ok=True)
    Tokenizer(WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<unk>"}, f)
    return path


def test_a_template_file_of_the_directory_is_read(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok")
    (tok / "chat_template.jinja").write_text(TEMPLATE)
    assert ChatTokenizer(str(tok)).chat_template == TEMPLATE
    (tok / "templates").mkdir()
    (tok / "chat_template.jinja").rename(tok / "templates" / "chat.jinja")
    os.symlink(os.path.join("templates", "chat.jinja"), tok / "chat_template.jinja")  # inside
    assert ChatTokenizer(str(tok)).chat_template == TEMPLATE


def test_a_hugging_face_cache_snapshot_reads_its_blobs(tmp_path):
    repo = tmp_path / "models--org--tiny"
    tok = tokenizer_dir(repo / "snapshots" / "0123abc")
    (repo / "blobs").mkdir()
    (repo / "blobs" / "deadbeef").write_text(TEMPLATE)
    os.symlink(os.path.join("..", "..", "blobs", "deadbeef"), tok / "chat_template.jinja")
    assert ChatTokenizer(str(tok)).chat_template == TEMPLATE


def test_a_template_linked_from_outside_the_directory_is_refused(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok")
    secret = tmp_path / "elsewhere.txt"
    secret.write_text("not the model's: " + TEMPLATE)
    os.symlink(secret, tok / "chat_template.jinja")
    with pytest.raises(TokenizerError) as err:
        ChatTokenizer(str(tok))
    assert str(err.value) == (
        f"{tok / 'chat_template.jinja'} resolves to {secret}, outside the model directory {tok}: "
        "refusing to read it; put the file itself in the directory")


@pytest.mark.parametrize("kind", ["fifo", "link to a fifo", "directory"])
def test_a_template_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    tok = tokenizer_dir(tmp_path / "tok")
    target = tok / "chat_template.jinja"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "link to a fifo":
        os.mkfifo(tok / "pipe")
        os.symlink("pipe", target)
    else:
        target.mkdir()
    with pytest.raises(TokenizerError, match=r"chat_template.jinja is not a regular file \(a FIFO, "
                                             r"device or directory\): refusing to read it"):
        ChatTokenizer(str(tok))
