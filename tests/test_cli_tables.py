"""Tables in, tables out (issue 43): Parquet, a folder of parts, CSV, TSV, Arrow and a saved dataset read as
records, written as Parquet or JSONL, with ids kept as written, kept columns carried, errors naming the row
and the column, exactly-once resume of a Parquet OUT after kill -9, and memory flat in the input's size.

The oracle for every generated text is the JSONL path on the same prompts (greedy, so equal texts).
"""
from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from typer.testing import CliRunner

from processes import REPO, env

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pcsv = pytest.importorskip("pyarrow.csv")

from llmcli.cli.app import app  # noqa: E402

MODEL = REPO / "examples" / "tiny-qwen3"
runner = CliRunner()
ENGINE = ["--model", str(MODEL), "--device", "cpu", "--num-kvcache-blocks", "64", "--kvcache-block-size", "16",
          "--max-num-seqs", "8", "--max-model-len", "256", "--temperature", "0", "--max-tokens", "3"]
# Awkward cells: commas, quotes, newlines, tabs, non-ASCII; ids with leading zeros that must stay strings.
ROWS = {"ticket_id": ["00123", "00124", "7", "0"],
        "body": ['card charged twice, "again"', "where is\nmy parcel?", "héllo\twörld", "refund please"],
        "lang": ["en", "en", "fr", "en"],
        "priority": [3, 1, 2, 5]}


def write_table(path: Path, kind: str, rows: dict = ROWS) -> Path:
    table = pa.table(rows)
    if kind == "parquet":
        pq.write_table(table, path / "in.parquet")
        return path / "in.parquet"
    if kind == "parts":
        (path / "parts").mkdir()
        for i, start in enumerate(range(0, table.num_rows, 3)):  # two parts, read in name order
            pq.write_table(table.slice(start, 3), path / "parts" / f"part-{i:05d}.parquet")
        return path / "parts"
    if kind in ("csv", "tsv"):
        out = path / f"in.{kind}"
        pcsv.write_csv(table, out, pcsv.WriteOptions(delimiter="\t" if kind == "tsv" else ",",
                                                     quoting_style="all_valid"))
        return out
    if kind == "arrow":
        with pa.ipc.new_file(path / "in.arrow", table.schema) as writer:
            writer.write_table(table, max_chunksize=2)
        return path / "in.arrow"
    if kind == "dataset":
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_dict(rows).save_to_disk(str(path / "saved"))
        return path / "saved"
    raise AssertionError(kind)


def generate(inp: Path | str, out: Path | str, *flags: str):
    return runner.invoke(app, ["generate", str(inp), "-o", str(out), *ENGINE, "-q", *flags])


def read_jsonl(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, dict]:
    """The JSONL path's answer to each ticket's prompt, by id."""
    tmp = tmp_path_factory.mktemp("reference")
    inp = tmp / "in.jsonl"
    inp.write_bytes(b"".join(orjson.dumps({"id": i, "prompt": p}) + b"\n"
                             for i, p in zip(ROWS["ticket_id"], ROWS["body"])))
    result = generate(inp, tmp / "out.jsonl")
    assert result.exit_code == 0, result.output
    return {line["id"]: line for line in read_jsonl(tmp / "out.jsonl")}


KINDS = ["parquet", "parts", "csv", "tsv", "arrow", "dataset"]


@pytest.mark.parametrize("kind", KINDS)
def test_each_input_kind_to_parquet(tmp_path, reference, kind):
    inp = write_table(tmp_path, kind)
    out = tmp_path / "labels.parquet"
    result = generate(inp, out, "--prompt-column", "body", "--id-column", "ticket_id", "--keep-columns", "lang,priority")
    assert result.exit_code == 0, result.output
    got = pq.read_table(out)
    assert got.column_names == ["id", "lang", "priority", "text", "finish_reason", "prompt_tokens",
                                "completion_tokens", "error"]
    rows = got.to_pylist()
    assert [r["id"] for r in rows] == ROWS["ticket_id"]  # input order, strings as written
    assert [r["lang"] for r in rows] == ROWS["lang"]
    # a CSV cell is the text it holds; Parquet, Arrow and datasets keep their column's type
    priority = [str(p) for p in ROWS["priority"]] if kind in ("csv", "tsv") else ROWS["priority"]
    assert [r["priority"] for r in rows] == priority
    for r in rows:
        want = reference[r["id"]]
        assert (r["text"], r["finish_reason"], r["error"]) == (want["text"], want["finish_reason"], None)
        assert (r["prompt_tokens"], r["completion_tokens"]) == (want["usage"]["prompt_tokens"],
                                                                 want["usage"]["completion_tokens"])


@pytest.mark.parametrize("kind", KINDS)
def test_each_input_kind_to_jsonl(tmp_path, reference, kind):
    inp = write_table(tmp_path, kind)
    out = tmp_path / "labels.jsonl"
    result = generate(inp, out, "--prompt-column", "body", "--id-column", "ticket_id", "--keep-columns", "all")
    assert result.exit_code == 0, result.output
    lines = read_jsonl(out)
    assert [line["id"] for line in lines] == ROWS["ticket_id"]
    for i, line in enumerate(lines):
        assert line["text"] == reference[line["id"]]["text"]
        assert (line["ticket_id"], line["body"], line["lang"]) == (ROWS["ticket_id"][i], ROWS["body"][i],
                                                                    ROWS["lang"][i])
        assert str(line["priority"]) == str(ROWS["priority"][i])


@pytest.mark.parametrize("flag,name,near", [("--prompt-column", "bdy", "body"),
                                            ("--id-column", "ticket", "ticket_id"),
                                            ("--keep-columns", "lang,prio", "priority")])
def test_a_misspelled_column_is_one_line_naming_it_and_the_nearest(tmp_path, flag, name, near):
    inp = write_table(tmp_path, "parquet")
    result = generate(inp, tmp_path / "out.parquet", "--prompt-column", "body", flag, name)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"{flag} " in lines[0] and f"no column {name.split(',')[-1]!r}" in lines[0] \
        and f"did you mean {near!r}" in lines[0], result.output
    assert not (tmp_path / "out.parquet").exists()


def test_a_table_without_a_prompt_column_names_its_columns(tmp_path):
    inp = write_table(tmp_path, "parquet")
    result = generate(inp, tmp_path / "out.jsonl")
    assert result.exit_code == 2
    assert "--prompt-column" in result.output and "ticket_id, body, lang, priority" in result.output


def test_bad_cells_name_the_row_and_the_column(tmp_path):
    rows = {"ticket_id": ["a", "b", "c"], "body": ["fine", "", "also fine"], "max_tokens": [2, -1, None]}
    inp = tmp_path / "t.parquet"
    pq.write_table(pa.table(rows), inp)
    failed = generate(inp, tmp_path / "o.parquet", "--prompt-column", "body", "--id-column", "ticket_id")
    assert failed.exit_code == 2
    assert f"{inp}: row 2, column body: is empty" in failed.output, failed.output
    assert not (tmp_path / "o.parquet").exists()
    skipped = generate(inp, tmp_path / "o.parquet", "--prompt-column", "body", "--id-column", "ticket_id",
                       "--on-error", "skip", "--ignore-eos")
    assert skipped.exit_code == 1, skipped.output
    got = pq.read_table(tmp_path / "o.parquet").to_pylist()
    assert [r["id"] for r in got] == ["a", "b", "c"]
    assert got[1]["error"] == "body: is empty" and got[1]["text"] is None
    # the max_tokens column is each row's own setting; an empty cell leaves the command line's (3)
    assert [got[0]["completion_tokens"], got[2]["completion_tokens"]] == [2, 3]


def test_choice_answers_the_bare_string_and_the_data_teams_job_is_one_command(tmp_path):
    # docs/cli.md "From a table": the job as one command
    tickets = tmp_path / "tickets.parquet"
    pq.write_table(pa.table(ROWS), tickets)
    out = tmp_path / "labels.parquet"
    result = runner.invoke(app, ["generate", str(tickets), "-o", str(out), "--prompt-column", "body",
                                 "--id-column", "ticket_id", "--system-prompt",
                                 "Label the support ticket: billing, shipping or other.",
                                 "--choice", "billing,shipping,other", "--keep-columns", "all",
                                 "--model", str(MODEL), "--device", "cpu", "-q"])
    assert result.exit_code == 0, result.output
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == ROWS["ticket_id"] and [r["ticket_id"] for r in rows] == ROWS["ticket_id"]
    assert [r["body"] for r in rows] == ROWS["body"] and [r["priority"] for r in rows] == ROWS["priority"]
    assert all(r["text"] in ("billing", "shipping", "other") and r["finish_reason"] == "stop" for r in rows), rows


def test_the_system_prompt_makes_each_row_a_conversation(tmp_path):
    # the same answer as a JSONL messages record with that system message
    tickets = write_table(tmp_path, "parquet")
    (tmp_path / "chat.jsonl").write_bytes(b"".join(
        orjson.dumps({"id": i, "messages": [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": p}]}) + b"\n"
        for i, p in zip(ROWS["ticket_id"], ROWS["body"])))
    assert generate(tmp_path / "chat.jsonl", tmp_path / "chat.out.jsonl").exit_code == 0
    (tmp_path / "system.txt").write_text("Be brief.")
    result = generate(tickets, tmp_path / "t.jsonl", "--prompt-column", "body", "--id-column", "ticket_id",
                      "--system-prompt-file", str(tmp_path / "system.txt"))
    assert result.exit_code == 0, result.output
    want = [(line["id"], line["text"]) for line in read_jsonl(tmp_path / "chat.out.jsonl")]
    assert [(line["id"], line["text"]) for line in read_jsonl(tmp_path / "t.jsonl")] == want


def test_a_messages_column_and_csv_output(tmp_path, reference):
    convs = [[{"role": "user", "content": p}] for p in ROWS["body"]]
    inp = tmp_path / "chats.parquet"
    pq.write_table(pa.table({"id": ROWS["ticket_id"], "messages": convs}), inp)
    (tmp_path / "chats.jsonl").write_bytes(b"".join(orjson.dumps({"id": i, "messages": m}) + b"\n"
                                                    for i, m in zip(ROWS["ticket_id"], convs)))
    assert generate(tmp_path / "chats.jsonl", tmp_path / "want.jsonl").exit_code == 0
    result = generate(inp, tmp_path / "out.csv", "--keep-columns", "messages")  # id and messages by their names
    assert result.exit_code == 0, result.output
    got = pcsv.read_csv(tmp_path / "out.csv", convert_options=pcsv.ConvertOptions(
        column_types={"id": pa.string(), "text": pa.string()}), parse_options=pcsv.ParseOptions(
        newlines_in_values=True)).to_pylist()
    assert [(r["id"], r["text"]) for r in got] == [(line["id"], line["text"]) for line in
                                                   read_jsonl(tmp_path / "want.jsonl")]
    assert [orjson.loads(r["messages"]) for r in got] == convs  # nested cells as JSON text in a CSV


def test_table_flags_on_a_jsonl_input_and_a_table_out_of_jsonl_are_usage_errors(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"prompt": "hi"}\n')
    result = generate(inp, tmp_path / "o.jsonl", "--prompt-column", "body")
    assert result.exit_code == 2 and "--prompt-column maps the columns of a table IN" in result.output
    result = generate(inp, tmp_path / "o.parquet")
    assert result.exit_code == 2 and "written from a table IN" in result.output


def test_without_pyarrow_a_table_input_is_one_line_naming_the_extra(tmp_path):
    inp = write_table(tmp_path, "parquet")
    code = ("import sys; sys.modules['pyarrow'] = None; from llmcli.cli.app import main; "
            f"sys.argv = ['llmcli', 'generate', {str(inp)!r}, '-o', {str(tmp_path / 'o.jsonl')!r}, "
            f"'--model', {str(MODEL)!r}]; main()")
    result = subprocess.run([sys.executable, "-c", code], env=env(), capture_output=True, timeout=120)
    err = result.stderr.decode().strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1, err
    assert "pyarrow" in err and "llmcli[tables]" in err


def test_resume_after_rows_are_appended_runs_only_the_new_ones(tmp_path, reference):
    first = {k: v[:2] for k, v in ROWS.items()}
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table(first), inp)
    out = tmp_path / "out.parquet"
    flags = ("--prompt-column", "body", "--id-column", "ticket_id")
    assert generate(inp, out, *flags).exit_code == 0
    refused = generate(inp, out, *flags)
    assert refused.exit_code == 2 and "--resume" in refused.output  # a finished OUT is not clobbered
    pq.write_table(pa.table(ROWS), inp)
    result = runner.invoke(app, ["generate", str(inp), "-o", str(out), *ENGINE, *flags, "--resume"])
    assert result.exit_code == 0, result.output
    assert "2 records to run (2 already answered in OUT)" in result.output
    rows = pq.read_table(out).to_pylist()
    assert [(r["id"], r["text"]) for r in rows] == [(i, reference[i]["text"]) for i in ROWS["ticket_id"]]


def test_kill_9_mid_run_then_resume_answers_every_row_once(tmp_path):
    n, max_tokens = 16, 24
    inp = tmp_path / "tickets.parquet"
    pq.write_table(pa.table({"ticket_id": [f"{i:05d}" for i in range(n)],
                             "body": [f"ticket number {i} about a parcel" for i in range(n)]}), inp)
    out = tmp_path / "labels.parquet"
    journal = tmp_path / ".labels.parquet.llmcli" / "journal.jsonl"
    command = [sys.executable, "-m", "llmcli", "generate", str(inp), "-o", str(out), "--prompt-column", "body",
               "--id-column", "ticket_id", "--model", str(MODEL), "--device", "cpu", "--num-kvcache-blocks", "64",
               "--kvcache-block-size", "16", "--max-num-seqs", "2", "--max-model-len", "256", "--temperature", "0",
               "--max-tokens", str(max_tokens), "--ignore-eos", "-q"]
    proc = subprocess.Popen(command, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        from processes import wait_for_lines

        wait_for_lines(proc, journal, 1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists(), "a killed run must not leave a half-written table"
    done = journal.read_bytes()
    whole = done[:done.rfind(b"\n") + 1]
    assert 1 <= whole.count(b"\n") < n, "the kill should land mid-way"
    resumed = subprocess.run([*command, "--resume"], env=env(), capture_output=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr.decode()
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [f"{i:05d}" for i in range(n)]  # every row once, in input order
    assert all(r["completion_tokens"] == max_tokens and r["error"] is None for r in rows)
    assert len(read_jsonl(journal)) == n  # the journal answers each row once too


STREAM_SCRIPT = """
import resource, sys
from llmcli.cli.io.index import index_input, read_records
from llmcli.cli.io.table_formats import input_format, open_input_table
from llmcli.cli.io.tables import ColumnFlags, TableInput, resolve_columns
table = open_input_table(sys.argv[1], input_format(sys.argv[1]))
columns = resolve_columns(table, ColumnFlags(prompt_column="body", id_column="ticket_id", keep_columns=["lang"]))
source = TableInput(table, columns, rows_in_carry=False)
index = index_input(source, set(), lambda rec: None)
rows = 0
for start in range(0, len(index), 1024):
    recs = read_records(source, index, start, min(start + 1024, len(index)))
    assert all(r.error is None and r.carry == {"lang": "en"} for r in recs)
    rows += len(recs)
assert rows == len(index) == int(sys.argv[2]), (rows, len(index))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.mark.slow
def test_a_million_row_parquet_input_streams_in_flat_memory(tmp_path):
    # The checking pass and the run's re-reading (cli/io/index.py, stream.py) over a table: 100x the rows,
    # the same peak within 150 MiB. Holding the rows' records as Python objects would add ~500 MiB.
    peaks = {}
    for n in (10_000, 1_000_000):
        inp = tmp_path / f"in{n}.parquet"
        with pq.ParquetWriter(inp, pa.schema([("ticket_id", pa.string()), ("body", pa.string()),
                                              ("lang", pa.string())])) as writer:
            for start in range(0, n, 100_000):
                ids = [f"{i:07d}" for i in range(start, min(n, start + 100_000))]
                writer.write_table(pa.table({"ticket_id": ids, "body": [f"ticket {i} about a parcel" for i in ids],
                                             "lang": ["en"] * len(ids)}))
        result = subprocess.run([sys.executable, "-c", STREAM_SCRIPT, str(inp), str(n)], env=env(),
                                capture_output=True, timeout=600)
        assert result.returncode == 0, result.stderr.decode()
        peaks[n] = int(result.stdout.decode().split()[-1])
    assert peaks[1_000_000] - peaks[10_000] < 150 * 1024, peaks


def test_regex_constrains_every_record_and_two_job_constraints_are_refused(tmp_path):
    import re

    inp = tmp_path / "in.jsonl"
    inp.write_bytes(b'{"prompt": "a number"}\n{"prompt": "another"}\n')
    result = generate(inp, tmp_path / "o.jsonl", "--regex", "[0-9]{3}", "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    assert all(re.fullmatch("[0-9]{3}", line["text"]) for line in read_jsonl(tmp_path / "o.jsonl"))
    (tmp_path / "schema.json").write_text('{"type": "object"}')
    both = generate(inp, tmp_path / "p.jsonl", "--choice", "a,b", "--json-schema", str(tmp_path / "schema.json"))
    assert both.exit_code == 2 and "--choice and --json-schema: give only one" in both.output


def test_settings_columns_carry_each_rows_constraint(tmp_path):
    import re

    # a list column of choices and a JSON-schema column as text: each row's own constraint
    rows = {"prompt": ["one", "two"], "guided_choice": [["red", "blue"], None],
            "guided_json": [None, '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], '
                                  '"additionalProperties": false}']}
    inp = tmp_path / "c.parquet"
    pq.write_table(pa.table(rows), inp)
    result = generate(inp, tmp_path / "c.jsonl", "--max-tokens", "24")
    assert result.exit_code == 0, result.output
    first, second = read_jsonl(tmp_path / "c.jsonl")
    assert first["text"] in ("red", "blue") and first["id"] == 0
    if second["finish_reason"] == "stop":
        assert set(orjson.loads(second["text"])) == {"a"}
    else:  # cut at max_tokens: still a prefix of such an object
        assert re.match(r'\{\s*"a"\s*:\s*-?[0-9]', second["text"]), second


def test_input_format_hf_reads_a_folder_of_a_dataset_repositorys_data_files(tmp_path, reference):
    data = tmp_path / "repo" / "data"
    data.mkdir(parents=True)
    table = pa.table({"id": ROWS["ticket_id"], "prompt": ROWS["body"]})
    pq.write_table(table.slice(0, 2), data / "train-00000-of-00002.parquet")
    pq.write_table(table.slice(2), data / "train-00001-of-00002.parquet")
    result = generate(tmp_path / "repo", tmp_path / "o.jsonl", "--input-format", "hf")
    assert result.exit_code == 0, result.output
    assert [(line["id"], line["text"]) for line in read_jsonl(tmp_path / "o.jsonl")] == \
        [(i, reference[i]["text"]) for i in ROWS["ticket_id"]]


@pytest.mark.parametrize("ext", ["tsv", "arrow"])
def test_tsv_and_arrow_outputs(tmp_path, reference, ext):
    inp = write_table(tmp_path, "parquet")
    out = tmp_path / f"labels.{ext}"
    result = generate(inp, out, "--prompt-column", "body", "--id-column", "ticket_id", "--keep-columns", "body")
    assert result.exit_code == 0, result.output
    if ext == "arrow":
        got = pa.ipc.open_file(out).read_all()
    else:
        got = pcsv.read_csv(out, parse_options=pcsv.ParseOptions(delimiter="\t", newlines_in_values=True),
                            convert_options=pcsv.ConvertOptions(column_types={"id": pa.string()}))
    rows = got.to_pylist()
    assert [(r["id"], r["body"], r["text"]) for r in rows] == [(i, b, reference[i]["text"]) for i, b in
                                                               zip(ROWS["ticket_id"], ROWS["body"])]


def test_a_repeated_id_names_both_rows(tmp_path):
    inp = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": ["x", "y", "x"], "prompt": ["a", "b", "c"]}), inp)
    result = generate(inp, tmp_path / "d.parquet.out.jsonl")
    assert result.exit_code == 2
    assert 'row 3, column id: duplicate id "x" (first used on row 1)' in result.output, result.output


@pytest.mark.parametrize("ext", ["parquet", "csv"])
def test_unordered_table_out_holds_rows_in_completion_order(tmp_path, ext):
    """Each row asks for its own number of tokens (EOS ignored), all run in one batch: the shortest finish
    first. With --unordered the table's rows, their ids and kept columns, come in that order (the journal's);
    without it, in input order, with the same answers."""
    lengths = [12, 1, 8, 2, 5]
    rows = {"ticket_id": [f"t{i}" for i in range(5)], "body": ROWS["body"] + ["one more"],
            "max_tokens": lengths, "lang": ["a", "b", "c", "d", "e"]}
    inp = tmp_path / "in.parquet"
    pq.write_table(pa.table(rows), inp)
    flags = ("--prompt-column", "body", "--id-column", "ticket_id", "--keep-columns", "lang", "--ignore-eos")

    def read(out: Path) -> list[dict]:
        if ext == "parquet":
            return pq.read_table(out).to_pylist()
        return pcsv.read_csv(out, parse_options=pcsv.ParseOptions(newlines_in_values=True)).to_pylist()

    ordered, unordered = tmp_path / f"ordered.{ext}", tmp_path / f"unordered.{ext}"
    assert generate(inp, ordered, *flags).exit_code == 0
    result = generate(inp, unordered, *flags, "--unordered")
    assert result.exit_code == 0, result.output
    by_length = sorted(range(5), key=lambda i: lengths[i])
    got = read(unordered)
    assert [r["id"] for r in got] == [f"t{i}" for i in by_length]
    assert [r["lang"] for r in got] == [rows["lang"][i] for i in by_length]
    assert [r["completion_tokens"] for r in got] == sorted(lengths)
    journal = read_jsonl(tmp_path / f".unordered.{ext}.llmcli" / "journal.jsonl")
    assert [r["id"] for r in got] == [line["id"] for line in journal]
    in_order = read(ordered)
    assert [r["id"] for r in in_order] == rows["ticket_id"]
    assert sorted(got, key=lambda r: r["id"]) == in_order
