"""Reading a user's videos.txt / prompts.txt and checking their clips (`load_dataset`, as training reads a `pairs`
dataset); every problem reported at once."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.helpers.datasets import pair_samples
from vidtune.data.sources import Clip, read_lines
from vidtune.data.video import write_video
from vidtune.errors import DataError


def two_frame_clip(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_video(path, np.zeros((2, 16, 16, 3), np.uint8), 24)


def make_dataset(root: Path, videos: str | bytes, prompts: str | bytes, clips: list[str] = ()) -> Path:
    """A dataset folder with the given list files; `clips` are created as two-frame videos."""
    root.mkdir(parents=True, exist_ok=True)
    for name in clips:
        two_frame_clip(root / name)
    for name, content in (("videos.txt", videos), ("prompts.txt", prompts)):
        data = content.encode("utf-8") if isinstance(content, str) else content
        (root / name).write_bytes(data)
    return root


def problems_of(root: Path, **data) -> list[str]:
    with pytest.raises(DataError) as caught:
        pair_samples(root, **data)
    return caught.value.problems


# ------------------------------------------------------------------------------------------- read_lines


def test_read_lines_handles_bom_crlf_and_trailing_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes(b"\xef\xbb\xbfa cat \r\n  a dog\r\n\r\n\r\n  \r\n")
    assert read_lines(path) == ["a cat", "a dog"]


def test_read_lines_handles_old_mac_line_ends_and_keeps_inner_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "videos.txt"
    path.write_bytes(b"a.mp4\r\rb.mp4\r")
    assert read_lines(path) == ["a.mp4", "", "b.mp4"]


def test_read_lines_keeps_unicode_captions(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("un café à Paris\n夕焼けの海\n", encoding="utf-8")
    assert read_lines(path) == ["un café à Paris", "夕焼けの海"]


def test_read_lines_names_the_line_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes("a cat\r\na dog\r\nun caf\u00e9\r\n".encode("latin-1"))
    with pytest.raises(DataError) as caught:
        read_lines(path)
    [problem] = caught.value.problems
    assert problem.startswith(
        "prompts.txt line 3 is not UTF-8 text: save prompts.txt with the encoding 'UTF-8'"
    )
    assert str(path) in str(caught.value)


def test_encoding_problem_is_reported_with_the_other_file_problems(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, b"a.mp4\nb.mp4\n", "cat\ncaf\u00e9\n".encode("cp1252"), clips=["a.mp4"])
    problems = problems_of(root)
    assert len(problems) == 1 and problems[0].startswith("prompts.txt line 2 is not UTF-8 text: save")


# ------------------------------------------------------------------------------------------ the two lists


def test_loads_relative_and_absolute_clip_paths(tmp_path: Path) -> None:
    elsewhere = two_frame_clip(tmp_path / "elsewhere" / "b.mp4")
    root = make_dataset(
        tmp_path / "data", f"clips/a.mp4\n{elsewhere}\n", "a red ball\na blue cube\n", clips=["clips/a.mp4"]
    )
    samples = pair_samples(root)
    assert samples == [
        Clip(video=root / "clips/a.mp4", caption="a red ball", index=0, line=1, bucket=0),
        Clip(video=elsewhere, caption="a blue cube", index=1, line=2, bucket=0),
    ]
    assert all(sample.video.is_absolute() for sample in samples)


def test_accepts_quoted_windows_style_paths(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, '"clips\\a.mp4"\n', "a red ball\n", clips=["clips/a.mp4"])
    assert pair_samples(root)[0].video == tmp_path / "clips" / "a.mp4"


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError) as caught:
        pair_samples(tmp_path / "nope")
    assert caught.value.problems == [f"The dataset folder {tmp_path / 'nope'} does not exist."]


def test_missing_list_files_are_reported_together(tmp_path: Path) -> None:
    problems = problems_of(tmp_path)
    assert len(problems) == 2
    assert problems[0].startswith(f"{tmp_path / 'videos.txt'} is missing: create it")
    assert problems[1].startswith(f"{tmp_path / 'prompts.txt'} is missing: create it")


def test_empty_list_file(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "\n\n", "a cat\n")
    assert problems_of(root) == [f"{root / 'videos.txt'} is empty: write one clip path per line."]


def test_more_clips_than_captions(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "a.mp4\nb.mp4\nc.mp4\n", "cat\ndog\n", clips=["a.mp4", "b.mp4", "c.mp4"])
    [problem] = problems_of(root)
    assert "videos.txt has 3 lines but prompts.txt has 2" in problem
    assert "videos.txt has 1 extra line, starting at line 3: 'c.mp4'" in problem


def test_more_captions_than_clips(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "a.mp4\n", "cat\ndog\nbird\n", clips=["a.mp4"])
    [problem] = problems_of(root)
    assert "videos.txt has 1 line but prompts.txt has 3" in problem
    assert "prompts.txt has 2 extra lines, starting at line 2: 'dog'" in problem


def test_empty_caption_names_its_line(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "a.mp4\nb.mp4\n", "cat\n   \n", clips=["a.mp4", "b.mp4"])
    # A blank last caption would be dropped as a trailing line, so this also reports the count.
    problems = problems_of(root)
    assert any("videos.txt has 2 lines but prompts.txt has 1" in problem for problem in problems)
    root = make_dataset(
        tmp_path / "x", "a.mp4\nb.mp4\nc.mp4\n", "cat\n\nbird\n", clips=["a.mp4", "b.mp4", "c.mp4"]
    )
    [problem] = problems_of(root)
    assert problem.startswith(
        "prompts.txt line 2 is empty: write the caption for the clip on videos.txt line 2"
    )


def test_empty_clip_line_in_the_middle(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "a.mp4\n\nc.mp4\n", "cat\ndog\nbird\n", clips=["a.mp4", "c.mp4"])
    [problem] = problems_of(root)
    assert problem.startswith("videos.txt line 2 is empty")


def test_missing_clip_names_line_and_resolved_path(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "a.mp4\nclips/typo.mp4\n", "cat\ndog\n", clips=["a.mp4"])
    [problem] = problems_of(root)
    assert problem.startswith("videos.txt line 2: the clip 'clips/typo.mp4' was not found")
    assert f"(looked for {tmp_path / 'clips' / 'typo.mp4'})" in problem


def test_a_clip_named_in_other_capitals_or_misspelt_gets_a_did_you_mean(tmp_path: Path) -> None:
    root = make_dataset(tmp_path, "Beach.MP4\nsunset.mp\nzzz.mp4\n", "sea\nsky\nnone\n",
                        clips=["beach.mp4", "sunset.mp4"])
    capitals, spelling, unlike = problems_of(root)
    assert "was not found" in capitals and "Did you mean beach.mp4 (the same name, in other capitals)?" in capitals
    assert "Did you mean sunset.mp4?" in spelling
    assert "Did you mean" not in unlike


def test_one_error_lists_every_bad_line(tmp_path: Path) -> None:
    root = make_dataset(
        tmp_path,
        "a.mp4\n\nmissing.mp4\nd.mp4\ne.mp4\n",
        "cat\ndog\nbird\n\nfish\nextra caption\n",
        clips=["a.mp4", "d.mp4", "e.mp4"],
    )
    problems = problems_of(root)
    assert len(problems) == 4, problems
    assert problems[0].startswith("videos.txt has 5 lines but prompts.txt has 6")
    assert problems[1].startswith("videos.txt line 2 is empty")
    assert problems[2].startswith("videos.txt line 3: the clip 'missing.mp4' was not found")
    assert problems[3].startswith("prompts.txt line 4 is empty")
    with pytest.raises(DataError) as caught:
        pair_samples(root)
    assert str(caught.value).startswith("The dataset has 4 problems")


# ------------------------------------------------------------------------------------------ the clips


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Real clips: good (25 frames at 24 fps), short (10 frames), random bytes, and a cut-off mp4."""
    folder = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    write_video(folder / "good.mp4", rng.integers(0, 256, (25, 32, 32, 3), dtype=np.uint8), 24)
    write_video(folder / "short.mp4", np.zeros((10, 32, 32, 3), np.uint8), 24)
    write_video(folder / "fast.mp4", np.zeros((40, 32, 32, 3), np.uint8), 30)
    (folder / "random.mp4").write_bytes(rng.integers(0, 256, 5000, dtype=np.uint8).tobytes())
    data = (folder / "good.mp4").read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) // 2])
    return folder


def listing(root: Path, folder: Path, names: list[str]) -> Path:
    """A dataset folder whose videos.txt names `folder`'s clips `names` (absolute paths), one caption each."""
    videos = "".join(f"{folder / name}\n" for name in names)
    return make_dataset(root, videos, "".join(f"caption {i}\n" for i in range(len(names))))


def test_every_clip_is_probed_once_per_sample(tmp_path: Path, clip_folder: Path) -> None:
    names = ["good.mp4", "short.mp4", "good.mp4"]  # the same clip twice, with two captions, is fine
    samples = pair_samples(listing(tmp_path, clip_folder, names), frames=10)
    assert [(s.info.path.name, s.info.num_frames, s.info.fps) for s in samples] == [
        ("good.mp4", 25, 24.0),
        ("short.mp4", 10, 24.0),
        ("good.mp4", 25, 24.0),
    ]


def test_every_bad_clip_is_reported_at_once(tmp_path: Path, clip_folder: Path) -> None:
    names = ["good.mp4", "random.mp4", "short.mp4", "good.mp4", "cut.mp4"]
    problems = problems_of(listing(tmp_path, clip_folder, names), frames=25)
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"videos.txt line 2 ({clip_folder / 'random.mp4'}): it is not a video file")
    assert problems[1] == (
        f"videos.txt line 3 ({clip_folder / 'short.mp4'}): it is too short: 0.42 s at its own 24 fps gives 10 "
        "frames; the bucket needs 25. Use a longer clip, lower data.frames; it is never stretched in time"
    )
    assert problems[2].startswith(f"videos.txt line 5 ({clip_folder / 'cut.mp4'}): the file is incomplete")


def test_clip_length_accounts_for_fps_resampling(tmp_path: Path, clip_folder: Path) -> None:
    # 40 frames at 30 fps: read at 15 fps they give 20 frames: enough for 20, not for 25.
    root = listing(tmp_path, clip_folder, ["fast.mp4"])
    assert pair_samples(root, frames=20, fps=15)[0].info.num_frames == 40
    [problem] = problems_of(root, frames=25, fps=15)
    assert "it is too short: 1.33 s at 15 fps gives 20 frames; the bucket needs 25" in problem
    assert "raise data.fps" in problem
