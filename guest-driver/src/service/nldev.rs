//! The RDMA devices the kernel has registered, as RDMA netlink's device dump
//! (`RDMA_NLDEV_CMD_GET`, what `rdma dev` prints) lists them.
//!
//! sysfs is not enough to see a device go: `rdma link delete rxe0` first takes the
//! device out of the registered set (the dump no longer lists it), then removes the
//! kernel's clients one by one, and the verbs client waits there until every program
//! that opened the device closes it; the device's sysfs directory and GID table stay
//! until then. The kernel's rdma_cm hears of the removal at that point
//! (`cma_remove_one`); the service hears of it from this dump, made on a socket of
//! [`super::netlink`].

use std::collections::BTreeMap;

use super::netlink::{Attrs, Msg, NO_ATTRS, NetlinkError, Socket, Step, request};

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

/// Why the dump failed.
#[derive(Debug, thiserror::Error)]
pub enum NldevError {
    /// The socket, or the kernel's answer (its errno, or a message that did not parse).
    #[error("RDMA netlink device dump: {0}")]
    Netlink(#[from] NetlinkError),
}

/// The device (name and index) of one message of the dump, when it is a device
/// message with both; one with a bad attribute names nothing.
pub fn device(m: Msg<'_>) -> Option<(String, u32)> {
    if m.kind != NLDEV_GET {
        return None;
    }
    let (mut name, mut index) = (None, None);
    for a in Attrs::new(m.payload) {
        let a = a.ok()?;
        match a.kind {
            ATTR_DEV_NAME => {
                let end = a
                    .value
                    .iter()
                    .position(|&b| b == 0)
                    .unwrap_or(a.value.len());
                name = std::str::from_utf8(&a.value[..end])
                    .ok()
                    .map(str::to_string);
            }
            ATTR_DEV_INDEX => index = a.u32(),
            _ => {}
        }
    }
    Some((name?, index?))
}

/// The registered RDMA devices (`rdma dev`): name and index. A device registered again
/// (deleted and added) has a new index.
pub fn registered_devices() -> Result<BTreeMap<String, u32>, NldevError> {
    let mut sock = Socket::open(NETLINK_RDMA, 0)?;
    let mut devices = BTreeMap::new();
    sock.request(
        |seq| request(NLDEV_GET, libc::NLM_F_DUMP as u16, seq, &[], NO_ATTRS),
        |m| {
            devices.extend(device(m));
            Ok(Step::More)
        },
    )?;
    Ok(devices)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::netlink::{NLMSG_HDRLEN, messages};

    fn msg(ty: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
        let mut m = request(ty, 0, 1, &[], attrs);
        m[6..8].copy_from_slice(&0u16.to_ne_bytes());
        m
    }

    fn devices_of(datagram: &[u8]) -> Vec<(String, u32)> {
        let ms = messages(datagram).unwrap_or_else(|e| panic!("{e}"));
        ms.into_iter().filter_map(device).collect()
    }

    #[test]
    fn the_dump_gives_the_device_names() {
        let mut buf = msg(NLDEV_GET, &[(1, &3u32.to_ne_bytes()), (2, b"rxe0\0")]);
        buf.extend(msg(
            NLDEV_GET,
            &[(1, &4u32.to_ne_bytes()), (2, b"mlx5_0\0")],
        ));
        let got = devices_of(&buf);
        assert_eq!(got, [("rxe0".to_string(), 3), ("mlx5_0".to_string(), 4)]);
        // A message without a name or an index, with a bad attribute, or of another
        // type names nothing.
        assert!(devices_of(&msg(NLDEV_GET, &[(2, b"rxe2\0")])).is_empty());
        assert!(devices_of(&msg(NLDEV_GET, &[(1, &[0; 4])])).is_empty());
        let mut bad = msg(NLDEV_GET, &[(1, &3u32.to_ne_bytes()), (2, b"rxe3\0")]);
        bad[NLMSG_HDRLEN + 8..NLMSG_HDRLEN + 10].copy_from_slice(&200u16.to_ne_bytes());
        assert!(devices_of(&bad).is_empty());
        let other = msg(NLDEV_GET + 1, &[(1, &3u32.to_ne_bytes()), (2, b"rxe0\0")]);
        assert!(devices_of(&other).is_empty());
    }
}
