//! `--pcap FILE`: every frame the wire port sends and receives, as the IPv4/UDP or
//! IPv6/UDP datagram it travels in (LINKTYPE_RAW, the version nibble tells them apart),
//! so Wireshark decodes RoCEv2 / InfiniBand / CM.
//!
//! A UDP socket never sees the IP header the kernel writes, so for the soft port's
//! sockets the capture carries the header pvcm computes the ICRC under (IPv4:
//! `Ipv4Repr::new`, identification 0, DF, TTL 64, correct lengths and header checksum,
//! UDP checksum 0; IPv6: `Ipv6Repr::new`, hop limit 64, the UDP checksum computed).
//! Datagrams a raw or packet socket reads, and those the packet port sends, are written
//! with their headers exactly as they are. Received datagrams are written as they
//! arrived (a bad ICRC stays bad in the capture).

use std::fs::File;
use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{SystemTime, UNIX_EPOCH};

use pcap_file::DataLink;
use pcap_file::pcap::{PcapHeader, PcapPacket, PcapWriter};
use pvcm_wire::roce::{self, IpRepr, UDP_HEADER_LEN, UdpRepr};

/// A byte sink the pcap writer fills; the capture moves its bytes to the file after
/// each batch (the writer itself offers no flush).
#[derive(Debug, Clone, Default)]
struct Pending(Arc<Mutex<Vec<u8>>>);

impl Write for Pending {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[derive(Debug)]
struct Inner {
    writer: PcapWriter<Pending>,
    file: File,
    pending: Pending,
    failed: bool,
}

/// A pcap capture shared by the device threads and the host loop.
#[derive(Debug)]
pub struct Capture {
    inner: Mutex<Inner>,
}

impl Capture {
    /// Creates (truncates) the file, mode 0600, and writes the pcap header. A symlink at
    /// `path` is refused (`O_NOFOLLOW`), so a link another local user planted cannot
    /// redirect the daemon's writes, and so is anything but a regular file.
    pub fn create(path: &Path) -> io::Result<Capture> {
        use std::os::unix::fs::FileTypeExt;
        let file = crate::files::owner_only()
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| {
                if e.raw_os_error() == Some(libc::ELOOP) {
                    io::Error::new(e.kind(), "is a symbolic link; give the file itself")
                } else {
                    e
                }
            })?;
        let ft = file.metadata()?.file_type();
        if !ft.is_file() || ft.is_fifo() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        // Truncate only once it is known to be our regular file.
        file.set_len(0)?;
        let pending = Pending::default();
        let header = PcapHeader {
            datalink: DataLink::RAW,
            snaplen: 65535,
            ..PcapHeader::default()
        };
        let writer = PcapWriter::with_header(pending.clone(), header)
            .map_err(|e| io::Error::other(e.to_string()))?;
        let c = Capture {
            inner: Mutex::new(Inner {
                writer,
                file,
                pending,
                failed: false,
            }),
        };
        c.flush();
        Ok(c)
    }

    /// Records one whole IPv4 or IPv6 datagram as it is (the raw and packet receive
    /// paths, the packet port's sends), header bytes as the sender wrote them.
    pub fn record_datagram(&self, datagram: &[u8]) {
        self.write(datagram);
    }

    fn write(&self, d: &[u8]) {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = inner
            .writer
            .write_packet(&PcapPacket::new(ts, d.len() as u32, d));
    }

    /// Records one datagram from `src` to `dst` with UDP payload `payload` (both
    /// addresses of one family; nothing is recorded for mixed ones).
    pub fn record(&self, src: SocketAddr, dst: SocketAddr, payload: &[u8]) {
        let Some(ip) = IpRepr::from_addrs(src.ip(), dst.ip()) else {
            return;
        };
        let hl = ip.header_len();
        let total = hl + UDP_HEADER_LEN + payload.len();
        let (Ok(total16), Ok(udp_len)) = (
            u16::try_from(total),
            u16::try_from(UDP_HEADER_LEN + payload.len()),
        ) else {
            return;
        };
        let ip = match ip {
            IpRepr::V4(h) => IpRepr::V4(roce::Ipv4Repr {
                total_len: total16,
                ..h
            }),
            IpRepr::V6(h) => IpRepr::V6(roce::Ipv6Repr {
                payload_len: udp_len,
                ..h
            }),
        };
        let mut d = Vec::with_capacity(total);
        d.resize(hl + UDP_HEADER_LEN, 0);
        let udp = UdpRepr {
            src_port: src.port(),
            dst_port: dst.port(),
            length: udp_len,
        };
        // Both header slices have at least the lengths emit checks for.
        let _ = ip.emit_header(&mut d[..hl]);
        let _ = udp.emit(&mut d[hl..]);
        d.extend_from_slice(payload);
        if let IpRepr::V6(h) = ip {
            let sum = roce::udp6_checksum(&h.src, &h.dst, &d[hl..]);
            roce::field::udp::CHECKSUM.set(&mut d[hl..], sum.into());
        }
        self.write(&d);
    }

    /// Moves what was recorded to the file.
    pub fn flush(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let bytes = std::mem::take(
            &mut *inner
                .pending
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        if bytes.is_empty() || inner.failed {
            return;
        }
        if let Err(e) = inner.file.write_all(&bytes) {
            tracing::error!(error = %e, "pcap write failed; capture stopped");
            inner.failed = true;
        }
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.flush();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pcap_file::pcap::PcapReader;
    use pvcm_wire::roce::Ipv4Repr;
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

    #[test]
    fn records_parse_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.pcap");
        let c = Capture::create(&p).unwrap();
        let a = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 1), 4791));
        let b = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), 4791));
        let a6 = SocketAddr::from(("2001:db8::1".parse::<Ipv6Addr>().unwrap(), 4791));
        let b6 = SocketAddr::from(("2001:db8::2".parse::<Ipv6Addr>().unwrap(), 49152));
        c.record(a, b, &[7u8; 280]);
        c.record(b, a, &[9u8; 13]);
        c.record(a6, b6, &[5u8; 280]);
        c.record(a, b6, &[5u8; 280]); // mixed families: nothing
        c.flush();
        let mut r = PcapReader::new(File::open(&p).unwrap()).unwrap();
        assert_eq!(r.header().datalink, DataLink::RAW);
        let p1 = r.next_packet().unwrap().unwrap();
        assert_eq!(p1.data.len(), 308);
        let ip = Ipv4Repr::parse(&p1.data).unwrap();
        assert_eq!(
            (IpAddr::V4(ip.src), IpAddr::V4(ip.dst), ip.total_len),
            (a.ip(), b.ip(), 308)
        );
        let p2 = r.next_packet().unwrap().unwrap();
        assert_eq!(p2.data.len(), 41);
        let p3 = r.next_packet().unwrap().unwrap();
        assert_eq!(p3.data.len(), 328);
        let ip6 = roce::Ipv6Repr::parse(&p3.data).unwrap();
        let udp6 = UdpRepr::parse(&p3.data[40..]).unwrap();
        assert_eq!(
            (IpAddr::V6(ip6.src), IpAddr::V6(ip6.dst)),
            (a6.ip(), b6.ip())
        );
        assert_eq!((udp6.src_port, udp6.dst_port), (4791, 49152));
        let sum = u16::from_be_bytes([p3.data[46], p3.data[47]]);
        assert_eq!(sum, roce::udp6_checksum(&ip6.src, &ip6.dst, &p3.data[40..]));
        assert!(r.next_packet().is_none());
    }

    #[test]
    fn a_planted_symlink_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("victim");
        std::fs::write(&target, b"precious").unwrap();
        let link = dir.path().join("cap.pcap");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = Capture::create(&link).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(std::fs::read(&target).unwrap(), b"precious");
        // A regular file is created 0600.
        let f = dir.path().join("ok.pcap");
        Capture::create(&f).unwrap();
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&f).unwrap().permissions().mode() & 0o777,
            0o600
        );
    }
}
