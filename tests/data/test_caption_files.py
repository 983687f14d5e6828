"""Captions written into each layout a source reads: the caption lands where training reads it, everything else
in the file stays byte for byte, and a failed write leaves the file as it was."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from vidtune.config import DataConfig
from vidtune.data import caption_files
from vidtune.data.caption_files import FolderCaptions, MetadataCaptions, PairsCaptions, open_caption_files
from vidtune.data.sources import read_sources
from vidtune.errors import DataError, VidtuneError


def touch(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(b"not decoded here")


def test_pairs_captions_go_to_the_clip_s_line_and_every_other_line_stays_as_it_was(tmp_path: Path):
    touch(tmp_path, "a.mp4", "b.png", "c.mp4")
    (tmp_path / "videos.txt").write_bytes(b"a.mp4\r\nb.png\r\ngone.mp4\r\nc.mp4\r\n")
    (tmp_path / "prompts.txt").write_bytes("\ufeffa cat\r\n\r\nkept for gone\r\n".encode())
    files = PairsCaptions(tmp_path)
    assert [(slot.where, slot.caption) for slot in files.slots] == [
        ("videos.txt line 1", "a cat"), ("videos.txt line 2", ""), ("videos.txt line 4", "")]
    assert len(files.problems) == 1 and "videos.txt line 3" in files.problems[0] and "gone.mp4" in files.problems[0]
    files.write(files.slots[1], "a dog\nrunning")  # made one line
    files.write(files.slots[2], "a car")  # past the end of prompts.txt: it grows to that line
    assert (tmp_path / "prompts.txt").read_bytes() == \
        "\ufeffa cat\r\na dog running\r\nkept for gone\r\na car\r\n".encode()
    assert files.target(files.slots[2]) == "prompts.txt line 4"


def test_pairs_captions_make_prompts_txt_that_training_reads(tmp_path: Path):
    touch(tmp_path, "clips/a.mp4", "clips/b.mp4")
    (tmp_path / "videos.txt").write_text("clips/a.mp4\nclips/b.mp4")
    files = open_caption_files(DataConfig(root=str(tmp_path)).sources()[0])
    for number, slot in enumerate(files.slots):
        files.write(slot, f"caption {number}")
    assert (tmp_path / "prompts.txt").read_text() == "caption 0\ncaption 1\n"
    report = read_sources(DataConfig(root=str(tmp_path)))
    assert [(clip.video.name, clip.caption) for clip in report.clips] == [("a.mp4", "caption 0"),
                                                                           ("b.mp4", "caption 1")]


def test_folder_captions_go_beside_each_clip_and_existing_ones_are_read(tmp_path: Path):
    touch(tmp_path, "shoot/a.mp4", "shoot/sub/b.jpg", "shoot/.hidden/c.mp4")
    (tmp_path / "shoot/a.txt").write_text("already\nthere\n")
    files = FolderCaptions(tmp_path / "shoot")
    assert [(slot.where, slot.caption) for slot in files.slots] == [("shoot/a.mp4", "already there"),
                                                                    ("shoot/sub/b.jpg", "")]
    files.write(files.slots[1], "  a  still ")
    assert (tmp_path / "shoot/sub/b.txt").read_bytes() == b"a still\n"
    assert not (tmp_path / "shoot/.hidden/c.txt").exists()


def test_two_samples_reading_one_caption_file_get_one_caption_and_the_second_is_reported(tmp_path: Path):
    touch(tmp_path, "clip.mp4", "clip.png")
    files = FolderCaptions(tmp_path)
    assert [slot.media.name for slot in files.slots] == ["clip.mp4"]
    assert files.problems == [f"{tmp_path.name}/clip.png shares its caption file clip.txt with {tmp_path.name}/clip.mp4"
                              ", which gets the caption; rename one of them to give each its own."]
    (tmp_path / "clip.txt").write_text("both\n")
    assert FolderCaptions(tmp_path).problems == []  # captioned: both read it, as training does


CSV = (b'file,"notes",caption\r\n'
       b'a.mp4,"keep, as ""is""",\r\n'
       b'\r\n'
       b'b.png,"two\nlines",old\r\n'
       b'gone.mp4,x,\r\n'
       b'c.mp4,last,\r\n')


def test_csv_captions_change_their_cell_only_and_keep_every_other_row_byte_for_byte(tmp_path: Path):
    touch(tmp_path, "a.mp4", "b.png", "c.mp4")
    sheet = tmp_path / "sheet.csv"
    sheet.write_bytes(CSV)
    files = MetadataCaptions(sheet, video_column="file")
    assert [(slot.where, slot.caption) for slot in files.slots] == [
        ("sheet.csv row 1 (line 2)", ""), ("sheet.csv row 3 (line 4)", "old"), ("sheet.csv row 5 (line 7)", "")]
    assert "sheet.csv row 4 (line 6)" in files.problems[0]
    files.write(files.slots[2], 'a "quoted", caption')
    assert sheet.read_bytes() == CSV.replace(b"c.mp4,last,\r\n", b'c.mp4,last,"a ""quoted"", caption"\r\n')
    files.write(files.slots[0], "first")
    rows = list(csv.DictReader(sheet.open(newline="")))
    assert [(row["file"], row["notes"], row["caption"]) for row in rows] == [
        ("a.mp4", 'keep, as "is"', "first"), ("b.png", "two\nlines", "old"), ("gone.mp4", "x", ""),
        ("c.mp4", "last", 'a "quoted", caption')]


def test_a_missing_csv_caption_column_is_added_and_training_reads_the_captions(tmp_path: Path):
    touch(tmp_path, "a.mp4", "b.mp4")
    sheet = tmp_path / "sheet.csv"
    sheet.write_bytes(b"video,source\na.mp4,camera 1\nb.mp4,camera 2\n")
    files = MetadataCaptions(sheet)
    files.write(files.slots[1], "b caption")
    assert sheet.read_bytes() == b"video,source,caption\na.mp4,camera 1\nb.mp4,camera 2,b caption\n"
    files.write(files.slots[0], "a caption")
    data = DataConfig(datasets=[{"type": "metadata", "path": str(sheet)}])
    assert [clip.caption for clip in read_sources(data).clips] == ["a caption", "b caption"]


def test_jsonl_captions_set_their_key_and_keep_every_other_line(tmp_path: Path):
    touch(tmp_path, "a.mp4", "b.mp4")
    sheet = tmp_path / "clips.jsonl"
    sheet.write_bytes(b'{"video": "a.mp4",  "take": 3}\n{"video":"b.mp4","caption":"old"}\nnot json\n')
    files = MetadataCaptions(sheet)
    assert [slot.caption for slot in files.slots] == ["", "old"]
    assert files.problems == ["clips.jsonl line 3: this is not valid JSON (Expecting value at character 1)."]
    files.write(files.slots[0], "ünïcode kept")
    assert sheet.read_bytes() == ('{"video": "a.mp4", "take": 3, "caption": "ünïcode kept"}\n'
                                  '{"video":"b.mp4","caption":"old"}\nnot json\n').encode()


def test_a_file_changed_on_disk_meanwhile_is_not_overwritten(tmp_path: Path):
    touch(tmp_path, "a.mp4", "b.mp4")
    (tmp_path / "videos.txt").write_text("a.mp4\nb.mp4\n")
    files = PairsCaptions(tmp_path)
    files.write(files.slots[0], "first")
    (tmp_path / "prompts.txt").write_text("edited by hand\n")
    with pytest.raises(VidtuneError, match="changed on disk"):
        files.write(files.slots[1], "second")
    assert (tmp_path / "prompts.txt").read_text() == "edited by hand\n"


def test_a_write_cut_short_leaves_the_file_as_it_was_and_no_temporary_file(tmp_path: Path, monkeypatch):
    touch(tmp_path, "a.mp4")
    sheet = tmp_path / "sheet.csv"
    sheet.write_bytes(CSV.replace(b"file", b"video"))
    files = MetadataCaptions(sheet)

    def killed(source, target):
        raise KeyboardInterrupt  # the moment between writing the new file and renaming it into place

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        files.write(files.slots[0], "new")
    assert sheet.read_bytes() == CSV.replace(b"file", b"video")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.mp4", "sheet.csv"]


def test_a_source_that_cannot_be_read_names_the_file_and_line(tmp_path: Path):
    with pytest.raises(DataError, match=r"videos\.txt"):
        PairsCaptions(tmp_path)
    sheet = tmp_path / "sheet.csv"
    sheet.write_text("path,caption\n")
    with pytest.raises(DataError, match=r"no column 'video' \(line 1"):
        MetadataCaptions(sheet)
    (tmp_path / "videos.txt").write_bytes(b"a.mp4\n\xff\n")
    with pytest.raises(DataError, match="line 2 is not UTF-8"):
        PairsCaptions(tmp_path)
    assert caption_files.one_line(" a\n b\tc ") == "a b c"
