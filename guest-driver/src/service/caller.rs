//! The calling process's memory: where a command's response goes (the kernel's
//! `copy_to_user`) and where SET_OPTION's value is (`copy_from_user`).
//!
//! A CUSE request carries the caller's thread ID; [`ProcessMemory`] reads and writes
//! that thread's address space with `process_vm_readv(2)` / `process_vm_writev(2)`,
//! which need the service to be allowed to ptrace the caller (root, or CAP_SYS_PTRACE).
//! A bad address, a process gone, or a partial transfer is `EFAULT`, as the kernel's
//! copy would be. Tests use [`FakeMemory`].

use std::collections::BTreeMap;

/// The errno a failed copy gives the caller.
pub const EFAULT: i32 = libc::EFAULT;

/// Access to the memory of the process that issued a command.
pub trait CallerMemory {
    /// Copies `buf.len()` bytes from the caller's address `addr`; `Err(errno)` if any of
    /// them cannot be read.
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), i32>;
    /// Copies `data` to the caller's address `addr`; `Err(errno)` if any of it cannot be
    /// written.
    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), i32>;
}

/// The memory of thread `tid` (the FUSE request's `pid`).
#[derive(Debug, Clone, Copy)]
pub struct ProcessMemory {
    tid: libc::pid_t,
}

impl ProcessMemory {
    /// The memory of thread `tid`.
    pub fn new(tid: u32) -> ProcessMemory {
        ProcessMemory {
            tid: tid as libc::pid_t,
        }
    }
}

impl CallerMemory for ProcessMemory {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), i32> {
        if buf.is_empty() {
            return Ok(());
        }
        let local = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: buf.len(),
        };
        // SAFETY: `local` describes `buf`, which is writable for its length for the
        // duration of the call; `remote` names memory of another process, which the
        // kernel checks (it never touches ours through it).
        let n = unsafe { libc::process_vm_readv(self.tid, &local, 1, &remote, 1, 0) };
        if n == buf.len() as isize {
            Ok(())
        } else {
            Err(EFAULT)
        }
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), i32> {
        if data.is_empty() {
            return Ok(());
        }
        let local = libc::iovec {
            iov_base: data.as_ptr() as *mut libc::c_void,
            iov_len: data.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as usize as *mut libc::c_void,
            iov_len: data.len(),
        };
        // SAFETY: `local` describes `data`, readable for its length for the call (the
        // kernel only reads it); `remote` is checked by the kernel against the caller.
        let n = unsafe { libc::process_vm_writev(self.tid, &local, 1, &remote, 1, 0) };
        if n == data.len() as isize {
            Ok(())
        } else {
            Err(EFAULT)
        }
    }
}

/// An address space of separate regions, for tests: reads and writes must fall inside
/// one region, else `EFAULT`.
#[derive(Debug, Default, Clone)]
pub struct FakeMemory {
    regions: BTreeMap<u64, Vec<u8>>,
}

impl FakeMemory {
    /// An empty address space.
    pub fn new() -> FakeMemory {
        FakeMemory::default()
    }

    /// Maps `len` zero bytes at `addr`.
    pub fn map(&mut self, addr: u64, len: usize) {
        self.regions.insert(addr, vec![0; len]);
    }

    /// The bytes at `addr .. addr + len`, if mapped.
    pub fn get(&self, addr: u64, len: usize) -> Option<&[u8]> {
        let (base, r) = self.regions.range(..=addr).next_back()?;
        let off = usize::try_from(addr - base).ok()?;
        r.get(off..off.checked_add(len)?)
    }

    fn get_mut(&mut self, addr: u64, len: usize) -> Option<&mut [u8]> {
        let (base, r) = self.regions.range_mut(..=addr).next_back()?;
        let off = usize::try_from(addr - *base).ok()?;
        r.get_mut(off..off.checked_add(len)?)
    }
}

impl CallerMemory for FakeMemory {
    fn read(&mut self, addr: u64, buf: &mut [u8]) -> Result<(), i32> {
        let src = self.get(addr, buf.len()).ok_or(EFAULT)?;
        buf.copy_from_slice(src);
        Ok(())
    }

    fn write(&mut self, addr: u64, data: &[u8]) -> Result<(), i32> {
        let dst = self.get_mut(addr, data.len()).ok_or(EFAULT)?;
        dst.copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fake_memory_bounds() {
        let mut m = FakeMemory::new();
        m.map(0x1000, 16);
        assert!(m.write(0x1008, &[1; 8]).is_ok());
        assert_eq!(m.write(0x1009, &[1; 8]), Err(EFAULT));
        assert_eq!(m.write(0x0fff, &[1]), Err(EFAULT));
        let mut b = [0u8; 4];
        assert!(m.read(0x100c, &mut b).is_ok());
        assert_eq!(b, [1; 4]);
        assert_eq!(m.read(0x2000, &mut b), Err(EFAULT));
    }

    /// Reads and writes this process's own memory through the system calls.
    #[test]
    fn process_memory_on_self() {
        let tid = std::process::id();
        let mut m = ProcessMemory::new(tid);
        let mut target = [0u8; 8];
        let addr = target.as_mut_ptr() as u64;
        assert!(m.write(addr, &[7; 8]).is_ok());
        // The write went through the kernel; read it back the same way.
        let mut back = [0u8; 8];
        assert!(m.read(addr, &mut back).is_ok());
        assert_eq!(back, [7; 8]);
        assert_eq!(std::hint::black_box(target), [7; 8]);
        assert_eq!(m.write(8, &[1]), Err(EFAULT), "unmapped page");
    }
}
