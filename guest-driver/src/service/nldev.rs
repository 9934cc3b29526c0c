//! The RDMA devices the kernel has registered, as RDMA netlink's device dump
//! (`RDMA_NLDEV_CMD_GET`, what `rdma dev` prints) lists them.
//!
//! sysfs is not enough to see a device go: `rdma link delete rxe0` first takes the
//! device out of the registered set (the dump no longer lists it), then removes the
//! kernel's clients one by one, and the verbs client waits there until every program
//! that opened the device closes it; the device's sysfs directory and GID table stay
//! until then. The kernel's rdma_cm hears of the removal at that point
//! (`cma_remove_one`); the service hears of it from this dump.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `NETLINK_RDMA`.
const NETLINK_RDMA: i32 = 20;
/// `RDMA_NL_NLDEV`, the client of the nldev commands.
const RDMA_NL_NLDEV: u16 = 5;
/// `RDMA_NLDEV_CMD_GET`.
const RDMA_NLDEV_CMD_GET: u16 = 1;
/// `RDMA_NL_GET_TYPE(RDMA_NL_NLDEV, RDMA_NLDEV_CMD_GET)`.
pub const NLDEV_GET: u16 = (RDMA_NL_NLDEV << 10) + RDMA_NLDEV_CMD_GET;
/// `RDMA_NLDEV_ATTR_DEV_INDEX`.
pub const ATTR_DEV_INDEX: u16 = 1;
/// `RDMA_NLDEV_ATTR_DEV_NAME`.
pub const ATTR_DEV_NAME: u16 = 2;
const NLMSG_HDR: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;

/// Why the dump failed.
#[derive(Debug, thiserror::Error)]
pub enum NldevError {
    /// The socket could not be made, or sending or receiving failed.
    #[error("RDMA netlink: {0}")]
    Io(#[from] io::Error),
    /// The kernel answered with an error.
    #[error("RDMA netlink device dump: the kernel answered errno {0}")]
    Kernel(i32),
    /// A message did not parse.
    #[error("RDMA netlink device dump: malformed message at byte {0}")]
    Malformed(usize),
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Reads the devices (name and index) of one datagram of the dump into `devices`;
/// whether it ended the dump (`NLMSG_DONE`).
pub fn parse_dump(buf: &[u8], devices: &mut BTreeMap<String, u32>) -> Result<bool, NldevError> {
    let mut at = 0;
    while at + NLMSG_HDR <= buf.len() {
        let len = u32_at(buf, at).ok_or(NldevError::Malformed(at))? as usize;
        let ty = u16_at(buf, at + 4).ok_or(NldevError::Malformed(at))?;
        if len < NLMSG_HDR || at + len > buf.len() {
            return Err(NldevError::Malformed(at));
        }
        match ty {
            NLMSG_DONE => return Ok(true),
            NLMSG_ERROR => {
                let e = u32_at(buf, at + NLMSG_HDR).ok_or(NldevError::Malformed(at))? as i32;
                if e != 0 {
                    return Err(NldevError::Kernel(-e));
                }
            }
            NLDEV_GET => {
                if let Some((name, index)) = device(&buf[at + NLMSG_HDR..at + len]) {
                    devices.insert(name, index);
                }
            }
            _ => {}
        }
        at += (len + 3) & !3;
    }
    Ok(false)
}

/// The `RDMA_NLDEV_ATTR_DEV_NAME` and `RDMA_NLDEV_ATTR_DEV_INDEX` among a message's
/// attributes.
fn device(mut attrs: &[u8]) -> Option<(String, u32)> {
    let (mut name, mut index) = (None, None);
    while attrs.len() >= 4 {
        let len = usize::from(u16_at(attrs, 0)?);
        let ty = u16_at(attrs, 2)? & 0x3FFF;
        if len < 4 || len > attrs.len() {
            return None;
        }
        let v = &attrs[4..len];
        match ty {
            ATTR_DEV_NAME => {
                let end = v.iter().position(|&b| b == 0).unwrap_or(v.len());
                name = std::str::from_utf8(&v[..end]).ok().map(str::to_string);
            }
            ATTR_DEV_INDEX => index = u32_at(v, 0),
            _ => {}
        }
        attrs = attrs.get((len + 3) & !3..).unwrap_or_default();
    }
    Some((name?, index?))
}

/// The registered RDMA devices (`rdma dev`): name and index. A device registered again
/// (deleted and added) has a new index.
pub fn registered_devices() -> Result<BTreeMap<String, u32>, NldevError> {
    // SAFETY: socket() takes integers and returns a new descriptor or -1.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            NETLINK_RDMA,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error().into());
    }
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let timeout = Duration::from_secs(1);
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: SO_RCVTIMEO reads a timeval of the size given, which `tv` is.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    let mut req = [0u8; NLMSG_HDR];
    req[0..4].copy_from_slice(&(NLMSG_HDR as u32).to_ne_bytes());
    req[4..6].copy_from_slice(&NLDEV_GET.to_ne_bytes());
    let flags = (libc::NLM_F_REQUEST | libc::NLM_F_DUMP) as u16;
    req[6..8].copy_from_slice(&flags.to_ne_bytes());
    req[8..12].copy_from_slice(&1u32.to_ne_bytes());
    // SAFETY: an all-zero sockaddr_nl is valid (the kernel as the destination).
    let mut dst: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    dst.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: `req` and `dst` live across the call, with the lengths given.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            req.as_ptr().cast(),
            req.len(),
            0,
            (&raw const dst).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error().into());
    }
    let mut names = BTreeMap::new();
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        // SAFETY: `buf` is writable for its length.
        let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error().into());
        }
        if n == 0 || parse_dump(&buf[..n as usize], &mut names)? {
            return Ok(names);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(ty: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = vec![0u8; NLMSG_HDR];
        for (t, v) in attrs {
            let len = 4 + v.len();
            m.extend_from_slice(&(len as u16).to_ne_bytes());
            m.extend_from_slice(&t.to_ne_bytes());
            m.extend_from_slice(v);
            m.resize((m.len() + 3) & !3, 0);
        }
        let len = m.len() as u32;
        m[0..4].copy_from_slice(&len.to_ne_bytes());
        m[4..6].copy_from_slice(&ty.to_ne_bytes());
        m
    }

    #[test]
    fn the_dump_gives_the_device_names() {
        let mut buf = msg(NLDEV_GET, &[(1, &3u32.to_ne_bytes()), (2, b"rxe0\0")]);
        buf.extend(msg(
            NLDEV_GET,
            &[(1, &4u32.to_ne_bytes()), (2, b"mlx5_0\0")],
        ));
        let mut names = BTreeMap::new();
        assert!(!parse_dump(&buf, &mut names).unwrap_or_else(|e| panic!("{e}")));
        let got: Vec<(&str, u32)> = names.iter().map(|(n, i)| (n.as_str(), *i)).collect();
        assert_eq!(got, [("mlx5_0", 4), ("rxe0", 3)]);
        let done = msg(NLMSG_DONE, &[(0, &[0; 4])]);
        assert!(parse_dump(&done, &mut names).unwrap_or_else(|e| panic!("{e}")));
        // An error message is the kernel's errno; a truncated message is malformed.
        let err = msg(NLMSG_ERROR, &[(0xFFEB, &[0; 16])]);
        let mut e = err.clone();
        e[NLMSG_HDR..NLMSG_HDR + 4].copy_from_slice(&(-1i32).to_ne_bytes());
        assert!(matches!(
            parse_dump(&e, &mut names),
            Err(NldevError::Kernel(1))
        ));
        let mut short = msg(NLDEV_GET, &[(2, b"rxe1\0")]);
        short[0..4].copy_from_slice(&200u32.to_ne_bytes());
        assert!(matches!(
            parse_dump(&short, &mut names),
            Err(NldevError::Malformed(0))
        ));
        // A message without a name or an index, or with a bad attribute, names nothing.
        let mut n2 = BTreeMap::new();
        let no_index = msg(NLDEV_GET, &[(2, b"rxe2\0")]);
        assert!(!parse_dump(&no_index, &mut n2).unwrap_or_else(|e| panic!("{e}")));
        let bad = msg(NLDEV_GET, &[(1, &[0; 4])]);
        assert!(!parse_dump(&bad, &mut n2).unwrap_or_else(|e| panic!("{e}")));
        assert!(n2.is_empty());
    }
}
