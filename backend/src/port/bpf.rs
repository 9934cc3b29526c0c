//! Classic BPF for the ports' socket filters: the opcodes, instructions with explicit
//! offsets ([`stmt`], [`jump`]) or symbolic labels ([`Asm`]), and [`attach`].

use std::collections::HashMap;
use std::hash::Hash;
use std::io;
use std::os::fd::RawFd;

use super::sys::cvt;

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
pub(crate) const BPF_LD: u16 = 0x00;
pub(crate) const BPF_LDX: u16 = 0x01;
pub(crate) const BPF_ALU: u16 = 0x04;
pub(crate) const BPF_JMP: u16 = 0x05;
pub(crate) const BPF_RET: u16 = 0x06;
pub(crate) const BPF_W: u16 = 0x00;
pub(crate) const BPF_H: u16 = 0x08;
pub(crate) const BPF_B: u16 = 0x10;
pub(crate) const BPF_ABS: u16 = 0x20;
pub(crate) const BPF_IND: u16 = 0x40;
pub(crate) const BPF_MSH: u16 = 0xa0;
pub(crate) const BPF_AND: u16 = 0x50;
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

/// A small classic-BPF assembler: instructions with symbolic jump targets, labels of
/// the caller's type `L`.
#[derive(Debug)]
pub(crate) struct Asm<L> {
    ins: Vec<(u16, u32, Target<L>, Target<L>)>,
    labels: HashMap<L, usize>,
}

impl<L> Default for Asm<L> {
    fn default() -> Self {
        Asm {
            ins: Vec::new(),
            labels: HashMap::new(),
        }
    }
}

/// Where a jump goes: on to the next instruction, or to a label.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Target<L> {
    /// The next instruction.
    Fall,
    /// The instruction at the label.
    To(L),
}

impl<L: Copy + Eq + Hash> Asm<L> {
    /// An instruction that does not jump.
    pub(crate) fn stmt(&mut self, code: u16, k: u32) {
        self.ins.push((code, k, Target::Fall, Target::Fall));
    }
    /// A conditional jump (`code`: the condition, `BPF_JEQ` and the like) against `k`.
    pub(crate) fn jump(&mut self, code: u16, k: u32, t: Target<L>, f: Target<L>) {
        self.ins.push((BPF_JMP | code | BPF_K, k, t, f));
    }
    /// An unconditional jump.
    pub(crate) fn goto(&mut self, l: L) {
        self.ins
            .push((BPF_JMP | BPF_JA, 0, Target::To(l), Target::Fall));
    }
    /// Puts label `l` at the next instruction.
    pub(crate) fn label(&mut self, l: L) {
        self.labels.insert(l, self.ins.len());
    }

    /// The program, or `None` if a jump does not fit its 8 bits (or `ja`'s 32).
    pub(crate) fn finish(&self) -> Option<Vec<libc::sock_filter>> {
        let off = |at: usize, t: Target<L>| -> Option<u32> {
            match t {
                Target::Fall => Some(0),
                Target::To(l) => {
                    let to = *self.labels.get(&l)?;
                    u32::try_from(to.checked_sub(at + 1)?).ok()
                }
            }
        };
        let mut p = Vec::with_capacity(self.ins.len());
        for (at, &(code, k, t, f)) in self.ins.iter().enumerate() {
            if code == BPF_JMP | BPF_JA {
                p.push(libc::sock_filter {
                    code,
                    jt: 0,
                    jf: 0,
                    k: off(at, t)?,
                });
                continue;
            }
            p.push(libc::sock_filter {
                code,
                jt: u8::try_from(off(at, t)?).ok()?,
                jf: u8::try_from(off(at, f)?).ok()?,
                k,
            });
        }
        Some(p)
    }
}
