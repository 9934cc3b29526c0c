//! Classic BPF for the ports' socket filters: the opcodes, instructions ([`stmt`],
//! [`jump`]), and [`attach`].

use std::io;
use std::os::fd::RawFd;

use super::sys::cvt;

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
pub(crate) const BPF_LD: u16 = 0x00;
pub(crate) const BPF_LDX: u16 = 0x01;
pub(crate) const BPF_JMP: u16 = 0x05;
pub(crate) const BPF_RET: u16 = 0x06;
pub(crate) const BPF_W: u16 = 0x00;
pub(crate) const BPF_H: u16 = 0x08;
pub(crate) const BPF_B: u16 = 0x10;
pub(crate) const BPF_ABS: u16 = 0x20;
pub(crate) const BPF_IND: u16 = 0x40;
pub(crate) const BPF_MSH: u16 = 0xa0;
pub(crate) const BPF_JA: u16 = 0x00;
pub(crate) const BPF_JEQ: u16 = 0x10;
pub(crate) const BPF_JSET: u16 = 0x40;
pub(crate) const BPF_K: u16 = 0x00;
/// What an accepting filter returns: the whole packet (as far as 64 KiB).
pub(crate) const BPF_ACCEPT: u32 = 0xFFFF;

/// An instruction that does not jump.
pub(crate) fn stmt(code: u16, k: u32) -> libc::sock_filter {
    libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

/// A conditional jump over `jt` instructions if true, `jf` if false.
pub(crate) fn jump(code: u16, k: u32, jt: u8, jf: u8) -> libc::sock_filter {
    libc::sock_filter { code, jt, jf, k }
}

/// Attaches classic BPF program `prog` to socket `fd` (`SO_ATTACH_FILTER`), replacing
/// the one it had.
pub(crate) fn attach(fd: RawFd, prog: &[libc::sock_filter]) -> io::Result<()> {
    let fprog = libc::sock_fprog {
        len: prog.len() as libc::c_ushort,
        filter: prog.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points at `prog`, which is live for the call; the kernel copies
    // the program.
    cvt(unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ATTACH_FILTER,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    })
    .map(|_| ())
}
