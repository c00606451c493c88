import pytest
from hypothesis import given
from hypothesis import strategies as st

from katsubushi_py.ids.encodings import ENCODINGS, MAX_U64, EncodingError, decode, decode_base32, encode

u64 = st.integers(0, MAX_U64)


@pytest.mark.parametrize("name", list(ENCODINGS))
@given(value=u64)
def test_round_trip(name: str, value: int) -> None:
    assert decode(encode(value, name), name) == value


@pytest.mark.parametrize("name", ["hex", "base32", "base58", "base62"])
@given(a=u64, b=u64)
def test_fixed_width_encodings_sort_like_the_ids(name: str, a: int, b: int) -> None:
    ea, eb = encode(a, name), encode(b, name)
    assert len(ea) == len(eb)
    assert (ea < eb) == (a < b)


def test_known_forms() -> None:
    id_ = 189608758458974208
    assert encode(id_, "dec") == "189608758458974208"
    assert encode(id_, "hex") == "02a1a02946400000"
    assert int(encode(id_, "hex"), 16) == id_
    # base64url of the 8 big-endian bytes, no padding
    import base64

    assert encode(id_, "base64url") == base64.urlsafe_b64encode(id_.to_bytes(8, "big")).decode().rstrip("=")
    assert len(encode(id_, "base32")) == 13
    assert len(encode(id_, "base58")) == 11
    assert len(encode(id_, "base62")) == 11
    assert encode(0, "base58") == "11111111111"
    assert encode(MAX_U64, "hex") == "ffffffffffffffff"


def test_crockford_is_forgiving_as_specified() -> None:
    text = encode(189608758458974208, "base32")
    assert decode(text.lower(), "base32") == 189608758458974208
    assert decode("0O", "base32") == 0
    assert decode("1IL", "base32") == decode("111", "base32")
    assert decode("1-1", "base32") == decode("11", "base32")


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("", "dec"),
        ("12a", "dec"),
        ("-5", "dec"),
        ("18446744073709551616", "dec"),
        ("١٢٣", "dec"),  # non-ASCII digits
        ("xyz", "hex"),
        ("1" * 17, "hex"),
        ("U", "base32"),
        ("ZZZZZZZZZZZZZ", "base32"),  # 65 bits
        ("0OIl", "base58"),
        ("zzzzzzzzzzz", "base58"),
        ("zzzzzzzzzzz", "base62"),
        ("!!!", "base62"),
        ("AAAAAAAAAA", "base64url"),
        ("AAAAAAAAAA+", "base64url"),
        ("AAAAAAAAAAB", "base64url"),  # non-canonical trailing bits
    ],
)
def test_bad_input_is_rejected(text: str, name: str) -> None:
    with pytest.raises(EncodingError):
        decode(text, name)


def test_unknown_encoding() -> None:
    with pytest.raises(EncodingError, match="unknown encoding"):
        encode(1, "base36")
    with pytest.raises(EncodingError):
        encode(-1, "hex")


def test_base32_refuses_letters_that_upper_case_onto_crockfords() -> None:
    """Found by fuzz/run.py (fuzz/findings/ids/): 'P' + U+0131 (a dotless i) upper-cased to 'PI' and
    decoded as 705; any non-ASCII character is refused, as in every other encoding."""
    for text in ("P\u0131", "\u0131", "\u017f0"):  # the dotless i; the long s upper-cases to S
        with pytest.raises(EncodingError, match="bad character"):
            decode_base32(text)
