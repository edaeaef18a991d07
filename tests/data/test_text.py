"""Tests for Enron parsing, document streaming and token packing."""

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dpmix_jax.data import text

PLAIN = """Message-ID: <1.JavaMail.evans@thyme>
Date: Mon, 14 May 2001 16:39:00 -0700 (PDT)
From: phillip.allen@enron.com
To: tim.belden@enron.com
Subject: Re: forecast
Mime-Version: 1.0
Content-Type: text/plain; charset=us-ascii
Content-Transfer-Encoding: 7bit

Here is our forecast.
> what is the forecast?
Talk soon.

 -----Original Message-----
From: Belden, Tim
Sent: Monday, May 14, 2001 3:00 PM
Please send the forecast.
"""

FORWARD = """From: phillip.allen@enron.com
To: john.lavorato@enron.com
Subject: Fw: meeting
Content-Type: text/plain; charset=us-ascii

John, see below.
---------------------- Forwarded by Phillip K Allen/HOU/ECT on 10/16/2000 01:42 PM -----------
The meeting moved to Friday.
"""

MULTIPART = """From: a@enron.com
To: b@enron.com
Subject: both
MIME-Version: 1.0
Content-Type: multipart/alternative; boundary="XX"

--XX
Content-Type: text/plain; charset=utf-8
Content-Transfer-Encoding: quoted-printable

Caf=C3=A9 at noon.
--XX
Content-Type: text/html

<p>Cafe at noon.</p>
--XX--
"""

ONLY_QUOTE = """From: c@enron.com
Subject: re

> nothing of mine
"""


@pytest.fixture
def maildir(tmp_path):
    root = tmp_path / "maildir"
    files = {
        "allen-p/sent/1.": PLAIN,
        "allen-p/sent/2.": FORWARD,
        "allen-p/sent/10.": MULTIPART,
        "allen-p/inbox/1.": "From: x@y\n\nnot sent by allen\n",
        "bass-e/_sent_mail/1.": ONLY_QUOTE,
        "lay-k/sent_items/3.": "From: k@enron.com\nSubject: hi\n\nThanks, Ken\n",
        "lay-k/sent_items/4.": "From: k@enron.com\nSubject: hi\n\nSee you.\n",
        "zipper-a/sent/1.": "From: z@enron.com\n\nOk.\n",
    }
    for rel, content in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(content)
    (root / "empty-u" / "sent").mkdir(parents=True)
    return tmp_path


def test_load_enron_strips_replies_and_forwards(maildir):
    docs = text.load_enron(maildir)
    assert docs.users == ("allen-p", "lay-k", "zipper-a")
    assert docs.texts == (
        "Here is our forecast.\nTalk soon.",
        "John, see below.",
        "Café at noon.",
        "Thanks, Ken",
        "See you.",
        "Ok.",
    )
    np.testing.assert_array_equal(docs.user_ids, [0, 0, 0, 1, 1, 2])
    assert docs[3] == text.UserDocument(user="lay-k", text="Thanks, Ken")
    assert docs.skipped == {"empty_body": 1, "users_without_messages": 2}
    assert len(text.load_enron(maildir / "maildir", folders=("inbox",))) == 1
    with pytest.raises(ValueError, match="no messages found"):
        text.load_enron(maildir, folders=("deleted_items",))
    with pytest.raises(ValueError, match="does not exist"):
        text.load_enron(maildir / "nowhere")


def test_split_by_user_is_disjoint(maildir):
    docs = text.load_enron(maildir)
    parts = docs.split_by_user((0.34, 0.33, 0.33), seed=0)
    assert sum(len(p) for p in parts) == len(docs)
    user_sets = [set(np.asarray(p.user_ids).tolist()) for p in parts]
    assert len(set().union(*user_sets)) == 3
    assert sum(len(s) for s in user_sets) == 3  # no user in two parts
    for part in parts:
        for i in range(len(part)):
            assert part[i].text in docs.texts


def test_clean_email_body_cuts_markers_case_insensitively():
    body = "Mine.\n>> old\n--- original message ---\nTheirs."
    assert text.clean_email_body(body) == "Mine."


def test_iter_documents_reads_jsonl_gz_parquet_with_cap(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "1.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 2}\n')
    with gzip.open(tmp_path / "a" / "2.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "three"}) + "\n")
    (tmp_path / "b").mkdir()
    pq.write_table(
        pa.table({"text": ["p1", "p2", "p3"], "n": [1, 2, 3]}), tmp_path / "b" / "x.parquet"
    )
    assert list(text.iter_documents(tmp_path / "a")) == ["one", "two", "three"]
    assert list(text.iter_documents(tmp_path, max_documents=4)) == ["one", "two", "three", "p1"]
    assert list(text.iter_documents(tmp_path / "b" / "x.parquet")) == ["p1", "p2", "p3"]
    domains = text.load_domains(tmp_path, max_documents_per_domain=2)
    assert domains == {"a": ["one", "two"], "b": ["p1", "p2"]}


def test_iter_documents_names_file_and_line_of_bad_records(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": "cut\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: invalid JSON"):
        list(text.iter_documents(bad))
    bad.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl line 2: no string field 'text'"):
        list(text.iter_documents(bad))
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ValueError, match=r"c.parquet has no column 'text'"):
        list(text.iter_documents(tmp_path / "c.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .jsonl"):
        list(text.iter_documents(tmp_path / "empty"))


def test_pack_sequences_reconstructs_the_stream_and_keeps_users_apart():
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    users = [7, 3, 7, 3]
    packed = text.pack_sequences(docs, seq_len=4, eos_id=0, group_ids=users)
    for user in (7, 3):
        rows = packed.group_ids == user
        stream = packed.tokens[rows][packed.mask[rows]].tolist()
        expected = [t for d, u in zip(docs, users, strict=True) if u == user for t in (*d, 0)]
        assert stream == expected
    # User 7 has 10 tokens with separators (3 rows), user 3 has 5 (2 rows); only tails are padded.
    np.testing.assert_array_equal(packed.group_ids, [7, 7, 7, 3, 3])
    np.testing.assert_array_equal(packed.mask.sum(axis=1), [4, 4, 2, 4, 1])
    assert (packed.tokens[~packed.mask] == 0).all()
    single = text.pack_sequences(docs, seq_len=5, eos_id=99)
    assert single.tokens.shape == (3, 5) and (single.group_ids == 0).all()
    assert single.tokens[single.mask].tolist() == [t for d in docs for t in (*d, 99)]


def test_document_tokens_layout_matches_naive_shift():
    docs = [[5, 6, 7], [8], [1, 2, 3, 4, 5, 6]]
    out = text.document_tokens(docs, max_len=4, eos_id=0)
    np.testing.assert_array_equal(out.token_counts, [3, 1, 4])
    np.testing.assert_array_equal(out.truncated, [False, False, True])
    for j, doc in enumerate(docs):
        kept = doc[:4]
        # Each scored target is predicted from end-of-text followed by the tokens before it.
        for t, token in enumerate(kept):
            assert out.targets[j, t] == token and out.mask[j, t]
            assert out.inputs[j, t] == ([0, *kept][t])
        assert not out.mask[j, len(kept) :].any()
    with pytest.raises(ValueError, match="document 1 has no tokens"):
        text.document_tokens([[1], []], max_len=3, eos_id=0)


def test_hostile_jsonl_and_parquet_records_are_one_line_naming_the_file(tmp_path):
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text('{"text": "fine"}\n{"text": "\\ud800"}\n')
    with pytest.raises(ValueError, match=r"surrogate\.jsonl line 2: .*lone surrogate U\+D800"):
        list(text.iter_documents(surrogate))
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(ValueError, match=r"nested\.jsonl line 1: JSON nested too deeply"):
        list(text.iter_documents(nested))
    garbage = tmp_path / "garbage.parquet"
    garbage.write_bytes(b"PAR1" + bytes(range(256)) * 4 + b"PAR1")
    with pytest.raises(ValueError) as raised:
        list(text.iter_documents(garbage))
    message = str(raised.value)
    assert message.startswith(f"{garbage}: not a readable Parquet file")
    assert message.isprintable() and "\n" not in message and len(message) < 400
