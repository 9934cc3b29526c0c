import gzip
import lzma
import unittest

from netlab.kernel_image import elf_of

ELF = b"\x7fELF\x02\x01\x01" + bytes(range(256)) * 64


class ElfOf(unittest.TestCase):
    """A bzImage is setup code, then the compressed kernel ELF at an offset of its own."""

    def test_xz(self):
        self.assertEqual(elf_of(b"MZ setup code " * 50 + lzma.compress(ELF, format=lzma.FORMAT_XZ) + b"\0" * 32), ELF)

    def test_gzip(self):
        self.assertEqual(elf_of(b"\0" * 1000 + gzip.compress(ELF, mtime=0) + b"\0" * 16), ELF)

    def test_a_false_magic_before_the_payload(self):
        # The xz magic in the setup code, not followed by a valid stream, is skipped.
        image = b"\xfd7zXZ\x00 not xz " + lzma.compress(ELF, format=lzma.FORMAT_XZ)
        self.assertEqual(elf_of(image), ELF)

    def test_compressed_but_not_an_elf(self):
        self.assertIsNone(elf_of(b"\0" * 64 + gzip.compress(b"plain data" * 100)))
        self.assertIsNone(elf_of(b""))


if __name__ == "__main__":
    unittest.main()
