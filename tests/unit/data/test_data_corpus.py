"""Specification of the corpus: which documents, in what order, and how they are split."""

from pathlib import Path

import pytest

from loom.config import ConfigError
from loom.data.corpus import Document, list_files, load_documents, split_documents, stdlib_root


def test_stdlib_root_is_this_interpreters_standard_library():
    root = stdlib_root()
    assert (root / "os.py").is_file()
    assert (root / "json" / "__init__.py").is_file()


def test_stdlib_corpus_is_sorted_py_sources_without_installed_packages():
    files = list_files("stdlib")  # listing only: cheap, reads no file contents
    names = [f.name for f in files]
    assert names == sorted(names)
    assert len(names) > 500 and "os.py" in names and "json/__init__.py" in names
    assert all(n.endswith(".py") for n in names)
    assert not any(part in ("site-packages", "dist-packages") for n in names for part in n.split("/"))
    assert all(f.size > 0 for f in files)


def test_max_bytes_keeps_the_leading_documents():
    everything = [f.name for f in list_files("stdlib")]
    docs = load_documents("stdlib", max_bytes=100_000)
    assert [d.name for d in docs] == everything[: len(docs)]
    assert 1 <= len(docs) < len(everything)
    assert sum(len(d.text.encode()) for d in docs) <= 100_000 or len(docs) == 1


def _docs(n: int) -> list[Document]:
    return [Document(f"pkg/module_{i:03d}.py", f"x = {i}\n") for i in range(n)]


def test_split_is_deterministic_disjoint_and_covers_all_documents():
    docs = _docs(200)
    train, val = split_documents(docs, 0.1)
    assert (train, val) == split_documents(docs, 0.1)
    assert {d.name for d in train}.isdisjoint(d.name for d in val)
    assert sorted(d.name for d in train + val) == [d.name for d in docs]
    assert 5 <= len(val) <= 40  # roughly the fraction
    assert [d.name for d in train] == sorted(d.name for d in train)  # order kept


def test_split_is_stable_when_documents_are_added():
    _, val = split_documents(_docs(100), 0.2)
    _, val_more = split_documents(_docs(150), 0.2)
    assert {d.name for d in val} <= {d.name for d in val_more}


@pytest.mark.parametrize("fraction", [0.0, 0.999])
def test_split_puts_at_least_one_document_in_each_side(fraction):
    train, val = split_documents(_docs(3), fraction)
    assert len(train) >= 1 and len(val) >= 1 and len(train) + len(val) == 3


def test_a_single_document_is_cut_at_a_line_boundary():
    text = "".join(f"line {i}\n" for i in range(100))
    train, val = split_documents([Document("book.txt", text)], 0.1)
    assert train[0].text + val[0].text == text
    assert train[0].text.endswith("\n") and 0 < len(val[0].text) < len(text) // 5


def test_user_directory_source(tmp_path: Path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.md").write_text("zed\n")
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "image.png").write_bytes(b"\x89PNG")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe end")
    docs = load_documents(tmp_path, extensions=(".txt", ".md"))
    assert [d.name for d in docs] == ["a.txt", "b/z.md", "bad.txt"]
    assert docs[2].text == "ok \ufffd\ufffd end"  # undecodable bytes replaced, not fatal


def test_user_single_file_source(tmp_path: Path):
    path = tmp_path / "notes.log"
    path.write_text("some notes\n")
    assert load_documents(path, extensions=(".txt",)) == [Document("notes.log", "some notes\n")]


def test_missing_source_names_the_config_field(tmp_path: Path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match="data.source") as err:
        load_documents(missing)
    assert str(missing) in str(err.value)


def test_directory_without_matching_files_is_an_error(tmp_path: Path):
    (tmp_path / "x.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match="data.extensions"):
        load_documents(tmp_path, extensions=(".txt",))
