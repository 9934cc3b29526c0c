"""The kernel's ELF image (vmlinux) out of its bzImage (vmlinuz), for build-guest.sh's
RDMA image: QEMU boots the ELF through its PVH entry point, which skips the bzImage's
self-decompression (seconds under TCG).

    python3 -m netlab.kernel_image VMLINUZ OUT

writes the ELF to OUT; exit 1 when VMLINUZ holds no xz- or gzip-compressed ELF.
"""

import lzma
import sys
import zlib

XZ_MAGIC = b"\xfd7zXZ\x00"
GZIP_MAGIC = b"\x1f\x8b\x08\x00"
ELF_MAGIC = b"\x7fELF"


def _unxz(data):
    return lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data)


def _ungz(data):
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(data)


def elf_of(bzimage):
    """The first ELF image compressed (xz, else gzip) inside BZIMAGE, or None. Each place
    a compression's magic appears is tried, as the compressed payload follows the
    bzImage's setup code at an offset the header does not give directly."""
    for magic, unpack in ((XZ_MAGIC, _unxz), (GZIP_MAGIC, _ungz)):
        at = bzimage.find(magic)
        while at >= 0:
            try:
                elf = unpack(bzimage[at:])
            except (lzma.LZMAError, zlib.error, EOFError):
                elf = b""
            if elf.startswith(ELF_MAGIC):
                return elf
            at = bzimage.find(magic, at + 1)
    return None


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        elf = elf_of(f.read())
    if elf is None:
        print(f"netlab.kernel_image: no compressed ELF image in {argv[0]}", file=sys.stderr)
        return 1
    with open(argv[1], "wb") as f:
        f.write(elf)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
