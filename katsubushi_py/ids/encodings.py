"""Text forms of an ID, each with a strict parser.

Every form encodes the ID's 8 big-endian bytes (an unsigned 64-bit value), not its decimal text.
Decimal, hex, Crockford base32, base58 and base62 are fixed width except decimal, and their
alphabets are in ASCII order, so sorting the strings sorts the IDs. base64url is the standard
RFC 4648 encoding of the 8 bytes without padding (11 characters) and does not sort.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable

MAX_U64 = (1 << 64) - 1

CROCKFORD32 = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
BASE62 = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


class EncodingError(ValueError):
    """Text that is not an ID in the requested encoding."""


def _width(base: int) -> int:
    width, span = 0, 1
    while span <= MAX_U64:
        span *= base
        width += 1
    return width


def _check(value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_U64:
        raise EncodingError(f"{value!r} is not an unsigned 64-bit ID")
    return value


def _make_positional(alphabet: str, name: str) -> tuple[Callable[[int], str], Callable[[str], int]]:
    base = len(alphabet)
    width = _width(base)
    digits = {ch: i for i, ch in enumerate(alphabet)}

    def encode(value: int) -> str:
        _check(value)
        out = []
        for _ in range(width):
            value, rem = divmod(value, base)
            out.append(alphabet[rem])
        return "".join(reversed(out))

    def decode(text: str) -> int:
        if not text or len(text) > width:
            raise EncodingError(f"{text!r} is not a {name} ID: expected 1 to {width} characters")
        value = 0
        for ch in text:
            digit = digits.get(ch)
            if digit is None:
                raise EncodingError(f"{text!r} is not a {name} ID: bad character {ch!r}")
            value = value * base + digit
        if value > MAX_U64:
            raise EncodingError(f"{text!r} is not a {name} ID: larger than 64 bits")
        return value

    return encode, decode


encode_base58, decode_base58 = _make_positional(BASE58, "base58")
encode_base62, decode_base62 = _make_positional(BASE62, "base62")
_encode_crockford, _decode_crockford = _make_positional(CROCKFORD32, "base32")

# Crockford's decoding is forgiving by design: any case, I/L read as 1, O as 0, hyphens ignored.
_CROCKFORD_ALIASES = str.maketrans({"I": "1", "L": "1", "O": "0", "-": None})


def encode_base32(value: int) -> str:
    return _encode_crockford(value)


def decode_base32(text: str) -> int:
    # ASCII first: str.upper() maps some other letters onto Crockford's (U+0131, the dotless i, onto 'I').
    if not text.isascii():
        bad = next(ch for ch in text if not ch.isascii())
        raise EncodingError(f"{text!r} is not a base32 ID: bad character {bad!r}")
    return _decode_crockford(text.upper().translate(_CROCKFORD_ALIASES))


def encode_decimal(value: int) -> str:
    return str(_check(value))


def decode_decimal(text: str) -> int:
    if not text or len(text) > 20 or not text.isascii() or not text.isdigit():
        raise EncodingError(f"{text!r} is not a decimal ID")
    value = int(text)
    if value > MAX_U64:
        raise EncodingError(f"{text!r} is not a decimal ID: larger than 64 bits")
    return value


def encode_hex(value: int) -> str:
    return f"{_check(value):016x}"


def decode_hex(text: str) -> int:
    body = text[2:] if text[:2] in ("0x", "0X") else text
    if not body or len(body) > 16 or any(ch not in "0123456789abcdefABCDEF" for ch in body):
        raise EncodingError(f"{text!r} is not a hex ID: expected up to 16 hex digits")
    return int(body, 16)


def encode_base64url(value: int) -> str:
    return base64.urlsafe_b64encode(_check(value).to_bytes(8, "big")).rstrip(b"=").decode("ascii")


def decode_base64url(text: str) -> int:
    if len(text) != 11 or not text.isascii():
        raise EncodingError(f"{text!r} is not a base64url ID: expected 11 characters")
    try:
        raw = base64.b64decode(text + "=", altchars=b"-_", validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EncodingError(f"{text!r} is not a base64url ID: {exc}") from None
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode("ascii") != text:
        # Non-canonical trailing bits would make two strings parse to one ID.
        raise EncodingError(f"{text!r} is not a canonical base64url ID")
    return int.from_bytes(raw, "big")


ENCODINGS: dict[str, tuple[Callable[[int], str], Callable[[str], int]]] = {
    "dec": (encode_decimal, decode_decimal),
    "hex": (encode_hex, decode_hex),
    "base32": (encode_base32, decode_base32),
    "base58": (encode_base58, decode_base58),
    "base62": (encode_base62, decode_base62),
    "base64url": (encode_base64url, decode_base64url),
}


def encode(value: int, encoding: str = "dec") -> str:
    try:
        encoder = ENCODINGS[encoding][0]
    except KeyError:
        raise EncodingError(f"unknown encoding {encoding!r}; choose from {', '.join(ENCODINGS)}") from None
    return encoder(value)


def decode(text: str, encoding: str = "dec") -> int:
    try:
        decoder = ENCODINGS[encoding][1]
    except KeyError:
        raise EncodingError(f"unknown encoding {encoding!r}; choose from {', '.join(ENCODINGS)}") from None
    return decoder(text.strip())
