//! Decodes a RoCEv2 CM frame layer by layer.
//!
//! ```text
//! cargo run -p pvcm-wire --example decode              # a sample CM REQ frame
//! cargo run -p pvcm-wire --example decode -- FILE      # raw UDP payload (280 bytes),
//!                                                      # a whole 308-byte IPv4 datagram
//!                                                      # or a whole 328-byte IPv6 one
//! echo 6400ffff... | cargo run -p pvcm-wire --example decode -- -   # hex on stdin
//! cargo run -p pvcm-wire --example decode -- FILE SRC_IP DST_IP [SRC_PORT]
//! ```
//!
//! A bare UDP payload carries no IP header, so its ICRC is checked only when the
//! addresses (and the source port, default 4791) are given, both IPv4 or both IPv6: an
//! IPv4 header is then assumed to be what Linux sends from an unconnected UDP socket
//! (ID 0, DF); an IPv6 header needs nothing more (the ICRC masks what the addresses do
//! not give). Bad input prints an error and exits with status 1.

use std::error::Error;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr};
use std::process::ExitCode;

use pvcm_wire::cm::{self, CmRepr, PathRepr, TransportService};
use pvcm_wire::mad::{self, AttributeId, Header};
use pvcm_wire::roce::{
    self, DATAGRAM_LEN, Frame, FrameRepr, IPV6_DATAGRAM_LEN, IpRepr, Ipv4Repr, UdpRepr,
};
use pvcm_wire::{Gid, roce::UDP_PORT};

type Res<T> = Result<T, Box<dyn Error>>;

/// rdma_cm's service ID prefix for the TCP port space (RDMA_PS_TCP << 16).
const RDMA_CM_TCP_SID: u64 = 0x0000_0000_0106_0000;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("decode: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let stdout = std::io::stdout();
    let w = &mut stdout.lock();
    let Some(input) = args.first() else {
        return sample(w);
    };
    let bytes = read_input(input)?;
    let headers = match (args.get(1), args.get(2)) {
        (Some(src), Some(dst)) => {
            let sport = match args.get(3) {
                Some(p) => p.parse().map_err(|e| format!("source port {p:?}: {e}"))?,
                None => UDP_PORT,
            };
            let (s, d): (IpAddr, IpAddr) = (src.parse()?, dst.parse()?);
            let ip = IpRepr::from_addrs(s, d)
                .ok_or("SRC_IP and DST_IP must both be IPv4 or both IPv6")?;
            Some((ip, UdpRepr::new(sport)))
        }
        (Some(_), None) => return Err("give both SRC_IP and DST_IP".into()),
        _ => None,
    };
    let version = bytes.first().map(|b| b >> 4);
    if (bytes.len() == DATAGRAM_LEN && version == Some(4))
        || (bytes.len() == IPV6_DATAGRAM_LEN && version == Some(6))
    {
        decode_datagram(w, &bytes)
    } else {
        decode_payload(w, &bytes, headers.as_ref().map(|(i, u)| (i, u)))
    }
}

/// Reads a file of raw bytes, or hex text from stdin for `-`.
fn read_input(path: &str) -> Res<Vec<u8>> {
    if path != "-" {
        return std::fs::read(path).map_err(|e| format!("{path}: {e}").into());
    }
    let mut text = String::new();
    std::io::stdin().read_to_string(&mut text)?;
    let digits: String = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| l.chars())
        .filter(|c| !c.is_whitespace() && *c != ':')
        .collect();
    let digits = digits.strip_prefix("0x").unwrap_or(&digits);
    if digits.len() % 2 != 0 {
        return Err(format!("odd number of hex digits ({})", digits.len()).into());
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| {
            let pair = digits.get(i..i + 2).ok_or("non-ASCII input")?;
            u8::from_str_radix(pair, 16).map_err(|_| format!("not hex: {pair:?}").into())
        })
        .collect()
}

/// Builds a sample CM REQ in a RoCEv2 datagram (127.0.1.1 -> 127.0.2.1) and decodes it.
fn sample(w: &mut dyn Write) -> Res<()> {
    let (src, dst) = (Ipv4Addr::new(127, 0, 1, 1), Ipv4Addr::new(127, 0, 2, 1));
    let rdma_cm_port: u16 = 18515;
    // rdma_cm's private data header for IPv4: version 0, IP version 4, source port,
    // then source and destination addresses in 16-byte slots.
    let mut private = [0u8; 36];
    private[1] = 0x40;
    private[2..4].copy_from_slice(&40000u16.to_be_bytes());
    private[16..20].copy_from_slice(&src.octets());
    private[32..36].copy_from_slice(&dst.octets());
    let path = PathRepr {
        // RoCE with hop limit > 1: permissive LIDs, not subnet local.
        local_lid: 0xFFFF,
        remote_lid: 0xFFFF,
        local_gid: Gid::from_ipv4(src),
        remote_gid: Gid::from_ipv4(dst),
        flow_label: 0,
        packet_rate: 0x3,
        traffic_class: 0,
        hop_limit: 64,
        sl: 0,
        subnet_local: false,
        local_ack_timeout: 18,
    };
    let req = cm::req::Repr {
        local_comm_id: 0x1a2b_3c4d,
        vendor_id: 0,
        service_id: RDMA_CM_TCP_SID | u64::from(rdma_cm_port),
        local_ca_guid: 0x0200_00ff_fe01_0101,
        local_qkey: 0,
        local_qpn: 0x11,
        responder_resources: 16,
        local_eecn: 0,
        initiator_depth: 16,
        remote_eecn: 0,
        remote_cm_response_timeout: 20,
        transport: TransportService::Rc,
        end_to_end_flow_control: true,
        starting_psn: 0x00c0_ffee,
        local_cm_response_timeout: 20,
        retry_count: 7,
        partition_key: 0xFFFF,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        primary_path: path,
        alternate_path: PathRepr::default(),
        sap_supported: false,
        private_data: &private,
    };
    let mut mad = [0u8; mad::MAD_LEN];
    CmRepr::Req(req).emit(
        &Header::cm_send(AttributeId::Req, 0x0000_0001_0000_0001),
        &mut mad,
    )?;
    let mut datagram = [0u8; DATAGRAM_LEN];
    FrameRepr::gsi(0, &mad).emit_datagram(
        &mut datagram,
        &Ipv4Repr::new(src, dst),
        &UdpRepr::new(UDP_PORT),
    )?;
    writeln!(w, "sample: a CM REQ from ::ffff:{src} to ::ffff:{dst}\n")?;
    decode_datagram(w, &datagram)
}

/// Decodes a whole IPv4 or IPv6 datagram: headers, then its frame.
fn decode_datagram(w: &mut dyn Write, bytes: &[u8]) -> Res<()> {
    let (ip, udp, frame) = roce::parse_ip_datagram(bytes)?;
    writeln!(w, "{ip}")?;
    writeln!(w, "{udp}")?;
    decode_frame(w, &frame, Some((&ip, &udp)))
}

/// Decodes a bare UDP payload.
fn decode_payload(
    w: &mut dyn Write,
    bytes: &[u8],
    headers: Option<(&IpRepr, &UdpRepr)>,
) -> Res<()> {
    let frame = Frame::new_checked(bytes)
        .map_err(|e| format!("not a RoCEv2 CM frame ({} bytes): {e}", bytes.len()))?;
    decode_frame(w, &frame, headers)
}

fn decode_frame(
    w: &mut dyn Write,
    frame: &Frame<&[u8]>,
    headers: Option<(&IpRepr, &UdpRepr)>,
) -> Res<()> {
    let repr = FrameRepr::parse(frame)?;
    writeln!(w, "{}", repr.bth)?;
    writeln!(w, "{}", repr.deth)?;
    let icrc_result = headers.map(|(ip, udp)| frame.check_icrc(ip, udp));
    let header = Header::parse(&mad::Packet::new_checked(frame.mad())?)
        .map_err(|e| format!("MAD header: {e}"))?;
    writeln!(w, "MAD {header}")?;
    match CmRepr::parse(frame.mad()) {
        Ok((_, msg)) => writeln!(w, "{msg}"),
        Err(e) => writeln!(w, "CM message not decoded: {e}"),
    }?;
    match &icrc_result {
        Some(Ok(())) => writeln!(w, "ICRC {:#010x} ok", frame.icrc()),
        Some(Err(e)) => writeln!(w, "ICRC BAD: {e}"),
        None => writeln!(
            w,
            "ICRC {:#010x} not checked (a bare UDP payload has no IP header: \
             give SRC_IP DST_IP [SRC_PORT])",
            frame.icrc()
        ),
    }?;
    writeln!(
        w,
        "\nframe ({} bytes, UDP payload):",
        frame.as_bytes().len()
    )?;
    hexdump(w, frame.as_bytes())?;
    match icrc_result {
        Some(Err(e)) => Err(e.into()),
        _ => Ok(()),
    }
}

fn hexdump(w: &mut dyn Write, bytes: &[u8]) -> Res<()> {
    for (i, chunk) in bytes.chunks(16).enumerate() {
        let hex: Vec<String> = chunk.iter().map(|b| format!("{b:02x}")).collect();
        let ascii: String = chunk
            .iter()
            .map(|&b| {
                if b.is_ascii_graphic() {
                    char::from(b)
                } else {
                    '.'
                }
            })
            .collect();
        writeln!(w, "{:04x}  {:<47}  {}", i * 16, hex.join(" "), ascii)?;
    }
    Ok(())
}
