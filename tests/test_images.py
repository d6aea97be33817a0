"""Image files read as transformers' load_image reads them: upright, transparency laid on white."""

import io

import numpy as np
import pytest
from PIL import Image

from retention.images import open_rgb


def _photo_turned(orientation: int) -> bytes:
    """A 40 x 20 JPEG, left half red and right half blue, whose EXIF says to turn it (as a phone writes)."""
    pixels = np.zeros((20, 40, 3), "uint8")
    pixels[:, :20, 0] = 255
    pixels[:, 20:, 2] = 255
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=95, exif=exif)
    return buf.getvalue()


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_a_photo_is_read_upright_as_transformers_reads_it(orientation, tmp_path):
    """A phone photo's EXIF orientation was ignored: the model saw it on its side (or upside down), where
    transformers' load_image (a path given to apply_chat_template) turns it upright."""
    from transformers.image_utils import load_image

    data = _photo_turned(orientation)
    path = tmp_path / "photo.jpg"
    path.write_bytes(data)
    want = np.array(load_image(str(path)))
    for source in (path, str(path), io.BytesIO(data)):
        got = open_rgb(source)
        assert got.mode == "RGB" and np.array_equal(np.array(got), want)
    assert want.shape[:2] == ((40, 20) if orientation in (6, 8) else (20, 40))
