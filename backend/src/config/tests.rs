//! The configuration's tests: the command line, both file formats, and their errors.

use std::net::{IpAddr, Ipv4Addr};
use std::str::FromStr;

use clap::Parser;
use pvcm_wire::Gid;

use super::*;

fn parse(args: &[&str]) -> Result<Config, ConfigError> {
    let mut argv = vec!["pvcm-backend"];
    argv.extend_from_slice(args);
    let cli = Cli::try_parse_from(argv).map_err(|e| ConfigError::Invalid(e.to_string()))?;
    Config::from_args(&cli.serve)
}

#[test]
fn users_and_groups_resolve_by_name_and_number() {
    assert_eq!(Account::Name("root".into()).user_id(), Some(0));
    assert_eq!(Account::Name("root".into()).group_id(), Some(0));
    assert_eq!(Account::Id(4242).user_id(), Some(4242));
    assert_eq!(Account::Name("no-such-group-pvcm".into()).group_id(), None);
    assert_eq!(Account::Name("no-such-user-pvcm".into()).user_id(), None);
}

#[test]
fn vm_spec_full() {
    let s: VmSpec = "socket=/tmp/a.sock,gid=::ffff:127.10.1.1,name=a,qpn-base=0x100,\
                     qpn-count=256,ca-guid=0x1122,quota=10"
        .parse()
        .unwrap();
    assert_eq!(s.socket, PathBuf::from("/tmp/a.sock"));
    assert_eq!(s.addr(), IpAddr::V4(Ipv4Addr::new(127, 10, 1, 1)));
    assert_eq!(s.vm.name, "a");
    assert_eq!((s.vm.qpn_base, s.vm.qpn_count), (0x100, 256));
    assert_eq!(s.vm.ca_guid, 0x1122);
    assert_eq!(s.vm.quota, Some(10));
    let d: VmSpec = "socket=/tmp/b,gid=127.0.0.9".parse().unwrap();
    assert_eq!(d.vm.name, "vm-127.0.0.9");
    assert_eq!(d.vm.gid, Gid::from_ipv4(Ipv4Addr::new(127, 0, 0, 9)));
    assert_eq!(d.iface, None);
    let v6: VmSpec = "socket=/tmp/c,gid=2001:db8::7".parse().unwrap();
    assert_eq!(v6.vm.name, "vm-2001:db8::7");
    assert_eq!(v6.addr(), "2001:db8::7".parse::<IpAddr>().unwrap());
    assert_eq!(v6.iface, None);
    let ll: VmSpec = "socket=/tmp/d,gid=fe80::5054:ff:fe00:1%br0"
        .parse()
        .unwrap();
    assert_eq!(ll.iface.as_deref(), Some("br0"));
    assert!(ll.vm.gid.is_link_local());
}

#[test]
fn vm_spec_errors() {
    for (s, want) in [
        ("gid=127.0.0.1", "socket=PATH is required"),
        ("socket=/a", "gid=GID is required"),
        ("socket=/a,gid=fe80::1", "link-local"),
        ("socket=/a,gid=fe80::1%", "not an interface"),
        ("socket=/a,gid=fe80::1%a/b", "not an interface"),
        ("socket=/a,gid=2001:db8::1%br0", "only a link-local"),
        ("socket=/a,gid=10.0.0.1%br0", "only a link-local"),
        ("socket=/a,gid=banana", "not a GID"),
        ("socket=/a,gid=0.0.0.0", "unspecified"),
        ("socket=/a,gid=::", "unspecified"),
        ("socket=/a,gid=::1", "loopback"),
        ("socket=/a,gid=ff02::1", "multicast"),
        ("socket=/a,gid=224.0.0.1", "multicast"),
        ("socket=/a,gid=::10.0.0.1", "IPv4-compatible"),
        ("socket=/a,gid=127.0.0.1,color=red", "unknown key"),
        ("socket=/a,gid=127.0.0.1,qpn-base=zz", "not a number"),
        (
            "socket=/a,gid=127.0.0.1,qpn-base=0xffffff,qpn-count=2",
            "24-bit",
        ),
        ("socket=/a,gid=127.0.0.1,qpn-base=0x1ffffffff", "32 bits"),
        ("socket=/a,gid=127.0.0.1,quota=0", "quota"),
        (
            "socket=/a,gid=127.0.0.1,id-range=0x80070000/16",
            "the default quota is 65536: give quota=32768 or less",
        ),
        (
            "socket=/a,gid=127.0.0.1,id-range=0x80070000/16,quota=32769",
            "quota=\"32769\": id-range",
        ),
        ("socket=/a,gid=127.0.0.1,socket=/b", "twice"),
        ("socket=/a,gid=127.0.0.1,banana", "key=value"),
    ] {
        let e = VmSpec::from_str(s).unwrap_err();
        assert!(e.to_string().contains(want), "{s}: {e}");
    }
}

#[test]
fn metrics_binds_loopback_unless_told_otherwise() {
    let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", "--metrics", "9791"]).unwrap();
    assert_eq!(c.metrics, Some("127.0.0.1:9791".parse().unwrap()));
    let c = parse(&[
        "--vm",
        "socket=/tmp/x,gid=127.1.0.1",
        "--metrics",
        "0.0.0.0:9791",
    ])
    .unwrap();
    assert_eq!(c.metrics, Some("0.0.0.0:9791".parse().unwrap()));
    let e = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", "--metrics", "x"]).unwrap_err();
    assert!(e.to_string().contains("--metrics"), "{e}");
}

#[test]
fn cli_values() {
    let c = parse(&[
        "--vm",
        "socket=/tmp/x,gid=127.1.0.1",
        "--vm",
        "socket=/tmp/y,gid=127.1.0.2",
        "--policy",
        "mlx4-post2020",
        "--rx-backlog",
        "8",
        "--bind-port",
        "4792",
        "--metrics",
        "127.0.0.1:9000",
    ])
    .unwrap();
    assert_eq!(c.vms.len(), 2);
    assert_eq!(c.policy, Policy::Mlx4Post2020);
    assert_eq!(
        (c.rx_backlog_bytes, c.bind_port),
        (8 * backlog::MSG_COST, 4792)
    );
    assert!(c.metrics.is_some());
    for (args, want) in [
        (
            &["--policy", "x", "--vm", "socket=/a,gid=127.0.0.1"][..],
            "--policy",
        ),
        (
            &["--vm", "socket=/a,gid=127.0.0.1", "--rx-backlog", "0"][..],
            "rx-backlog",
        ),
        (
            &["--vm", "socket=/a,gid=127.0.0.1", "--bind-port", "70000"][..],
            "bind-port",
        ),
        (
            &["--vm", "socket=/a,gid=127.0.0.1", "--metrics", "x"][..],
            "--metrics",
        ),
        (&[][..], "no VM"),
        (
            &[
                "--vm",
                "socket=/a,gid=127.0.0.1",
                "--vm",
                "socket=/a,gid=127.0.0.2",
            ][..],
            "socket",
        ),
        (
            &[
                "--vm",
                "socket=/a,gid=127.0.0.1",
                "--vm",
                "socket=/b,gid=127.0.0.1",
            ][..],
            "GID",
        ),
    ] {
        let e = parse(args).unwrap_err();
        assert!(e.to_string().contains(want), "{args:?}: {e}");
    }
}

#[test]
fn typed_values_from_the_command_line_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pvcm.conf");
    std::fs::write(
        &f,
        "vm socket=/tmp/p,gid=127.2.0.1\nrx-backlog-bytes 4M\nrx-host-backlog-bytes=1G\n\
         bind-port 0x12b8\nseed 0x10\nmetrics 9000\ncontrol /tmp/ctl\n",
    )
    .unwrap();
    let c = parse(&["--config", f.to_str().unwrap()]).unwrap();
    assert_eq!(c.rx_backlog_bytes, 4 << 20);
    assert_eq!(c.rx_host_backlog_bytes, 1 << 30);
    assert_eq!((c.bind_port, c.seed), (0x12b8, Some(16)));
    assert_eq!(c.metrics, Some("127.0.0.1:9000".parse().unwrap()));
    assert_eq!(c.control, Some(PathBuf::from("/tmp/ctl")));
    // The command line wins over the file.
    let c = parse(&[
        "--config",
        f.to_str().unwrap(),
        "--rx-host-backlog-bytes",
        "2G",
        "--seed",
        "7",
        "--metrics",
        "0.0.0.0:9001",
    ])
    .unwrap();
    assert_eq!(c.rx_host_backlog_bytes, 2 << 30);
    assert_eq!(c.seed, Some(7));
    assert_eq!(c.metrics, Some("0.0.0.0:9001".parse().unwrap()));
    for (args, want) in [
        (&["--rx-backlog-bytes", "12Q"][..], "--rx-backlog-bytes"),
        (&["--rx-host-backlog-bytes", "100"][..], "a size from"),
        (&["--rx-host-backlog-bytes", "65G"][..], "64G"),
        (&["--bind-port", "0"][..], "must be 1 to 65535"),
        (&["--bind-port", "x"][..], "not a number"),
        (&["--seed", "banana"][..], "--seed"),
        (&["--rx-backlog", "0x"][..], "not a number"),
    ] {
        let mut a = vec!["--vm", "socket=/a,gid=127.0.0.1"];
        a.extend_from_slice(args);
        let e = parse(&a).unwrap_err();
        assert!(e.to_string().contains(want), "{args:?}: {e}");
    }
    // A bad value in the file names the file, the line and the key.
    std::fs::write(&f, "vm socket=/tmp/p,gid=127.2.0.1\nbind-port 70000\n").unwrap();
    let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
    assert!(
        e.to_string().contains("--config")
            && e.to_string()
                .contains("line 2: bind-port=\"70000\": must be 1 to 65535"),
        "{e}"
    );
}

#[test]
fn config_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pvcm.conf");
    std::fs::write(
        &f,
        "# two VMs\nvm socket=/tmp/p,gid=127.2.0.1,name=p\n\npolicy mlx4-pre2020\n\
         rx-backlog=16\n",
    )
    .unwrap();
    let c = parse(&[
        "--config",
        f.to_str().unwrap(),
        "--vm",
        "socket=/tmp/q,gid=127.2.0.2",
        "--rx-backlog",
        "32",
    ])
    .unwrap();
    assert_eq!(c.vms.len(), 2);
    assert_eq!(c.vms[0].vm.name, "p");
    assert_eq!(c.policy, Policy::Mlx4Pre2020);
    assert_eq!(c.rx_backlog_bytes, 32 * backlog::MSG_COST);
    std::fs::write(&f, "colour blue\n").unwrap();
    let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
    assert!(e.to_string().contains("--config"), "{e}");
    let e = parse(&["--config", "/nonexistent/pvcm.conf"]).unwrap_err();
    assert!(e.to_string().contains("/nonexistent"), "{e}");
}

const TOML: &str = r#"
# a host with two VMs
policy = "default"
port = "soft"
wire-rx = "udp"
bind-port = 0x12b7
control = "/run/pvcm/control.sock"
metrics = 9791
rx-backlog-bytes = "4M"
rx-host-backlog-bytes = 1073741824
state-dir = "/var/lib/pvcm"
reconnect-grace = 30
socket-group = 0
socket-mode = "0640"
control-mode = "0660"
log-format = "json"

[[vm]]
name = "vm1"
socket = "/run/pvcm/vm1.sock"
gid = "::ffff:192.0.2.11"
qpn-base = 16
qpn-count = 0x20000
ca-guid = "0x0002c90300a1b2c3"
quota = 4096

[[vm]]
name = "vm2"
socket = "/run/pvcm/vm2.sock"
gid = "2001:db8::12"
id-range = "0x80070000/16"
quota = 32768
incoming = true
"#;

fn toml_file(text: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("backend.toml");
    std::fs::write(&f, text).unwrap();
    (dir, f)
}

#[test]
fn a_toml_file_sets_every_kind_of_value() {
    let (_d, f) = toml_file(TOML);
    let c = parse(&["--config", f.to_str().unwrap()]).unwrap();
    assert_eq!(c.vms.len(), 2);
    let (a, b) = (&c.vms[0], &c.vms[1]);
    assert_eq!(a.vm.name, "vm1");
    assert_eq!((a.vm.qpn_base, a.vm.qpn_count), (16, 0x20000));
    assert_eq!(a.vm.ca_guid, 0x0002_c903_00a1_b2c3);
    assert_eq!(a.vm.quota, Some(4096));
    assert!(b.incoming && b.vm.id_range.is_some());
    assert_eq!(b.addr(), "2001:db8::12".parse::<IpAddr>().unwrap());
    assert_eq!(c.wire_rx, RxMode::Udp);
    assert_eq!(c.bind_port, 0x12b7);
    assert_eq!(c.metrics, Some("127.0.0.1:9791".parse().unwrap()));
    assert_eq!(
        (c.rx_backlog_bytes, c.rx_host_backlog_bytes),
        (4 << 20, 1 << 30)
    );
    assert_eq!(c.reconnect_grace, std::time::Duration::from_secs(30));
    assert_eq!(c.state_dir, Some(PathBuf::from("/var/lib/pvcm")));
    assert_eq!(
        c.vm_sockets,
        SocketAccess {
            owner: None,
            group: Some(0),
            mode: 0o640
        }
    );
    assert_eq!(c.control_access.mode, 0o660);
    assert_eq!(c.log_format, LogFormat::Json);
    // The command line comes after the file.
    let c = parse(&[
        "--config",
        f.to_str().unwrap(),
        "--vm",
        "socket=/tmp/c,gid=127.3.0.3",
        "--socket-mode",
        "600",
    ])
    .unwrap();
    assert_eq!(c.vms.len(), 3);
    assert_eq!(c.vm_sockets.mode, 0o600);
}

#[test]
fn toml_errors_name_the_file_and_the_key() {
    let vm = "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n";
    for (text, want) in [
        (
            "bind-port = 70000\n".to_string() + vm,
            "bind-port=\"70000\"",
        ),
        ("bind-port = 70000\n".to_string() + vm, "must be 1 to 65535"),
        (
            "colour = \"blue\"\n".to_string() + vm,
            "unknown key \"colour\"",
        ),
        (
            "policy = \"mlx5\"\n".to_string() + vm,
            "policy=\"mlx5\": unknown policy",
        ),
        ("wire-rx = \"fast\"\n".to_string() + vm, "wire-rx=\"fast\""),
        ("wire-rx = \"fast\"\n".to_string() + vm, "auto, raw, udp"),
        (
            "metrics = [1, 2]\n".to_string() + vm,
            "metrics: expected a string",
        ),
        ("socket-mode = \"0999\"\n".to_string() + vm, "socket-mode"),
        (
            "socket-group = \"no-such-group-pvcm\"\n".to_string() + vm,
            "no such group",
        ),
        (
            "control-owner = \"no-such-user-pvcm\"\n".to_string() + vm,
            "control-owner",
        ),
        ("config = \"/etc/x\"\n".to_string() + vm, "cannot include"),
        ("vm = 3\n".to_string(), "vm: expected an array of tables"),
        ("policy = \n".to_string() + vm, "line 1"),
        (
            "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n[[vm]]\nname = \"b\"\n\
             socket = \"/tmp/b\"\ngid = \"127.0.0.2\"\nqpn-base = \"zz\"\n"
                .to_string(),
            "[[vm]] #2 (b): qpn-base=\"zz\": not a number",
        ),
        (
            "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\ncolor = 1\n".to_string(),
            "[[vm]] #1: unknown key \"color\"",
        ),
        (
            "[[vm]]\nsocket = \"/tmp/a\"\ngid = [1]\n".to_string(),
            "[[vm]] #1: gid=\"[1]\": expected a GID (a string) or an array of GIDs",
        ),
        (
            "[[vm]]\nsocket = \"/tmp/a\"\n".to_string(),
            "gid=GID is required",
        ),
        ("policy = \"default\"\n".to_string(), "no VM"),
    ] {
        let (_d, f) = toml_file(&text);
        let e = parse(&["--config", f.to_str().unwrap()]).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains(want), "{text}: {msg}");
        // Names are looked up once file and command line are merged: the key says it.
        if !matches!(e, ConfigError::NoVm | ConfigError::NoSuchAccount { .. }) {
            assert!(msg.contains("backend.toml"), "{text}: {msg}");
        }
    }
}

#[test]
fn every_long_option_is_a_toml_key() {
    // A file that names every option but --vm and --config (and the hidden ones the
    // tests use) parses: the file takes what the command line takes.
    let mut text = String::new();
    for k in config_keys() {
        let v = match k.as_str() {
            "vm" => continue,
            "policy" => "\"default\"",
            "control" | "pcap" | "state-dir" | "sysfs" => "\"/tmp/pvcm-x\"",
            "metrics" => "9791",
            "rx-backlog-bytes" | "rx-host-backlog-bytes" => "\"1M\"",
            "wire-rx" => "\"auto\"",
            "port" => "\"soft\"",
            "socket-owner" | "socket-group" | "control-owner" | "control-group" => "0",
            "socket-mode" | "control-mode" => "\"0600\"",
            "log-format" => "\"text\"",
            "allow-world-access" => "true",
            "path-mtu" => "2048",
            _ => "7",
        };
        text.push_str(&format!("{k} = {v}\n"));
    }
    text.push_str("[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n");
    let (_d, f) = toml_file(&text);
    parse(&["--config", f.to_str().unwrap()]).unwrap();
}

#[test]
fn path_values_where_the_port_cannot_tell_them() {
    let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1"]).unwrap();
    assert_eq!((c.path_mtu, c.ca_ack_delay), (pvcm_wire::abi::MTU_1024, 15));
    assert_eq!(c.rx_coalesce, std::time::Duration::from_micros(50));
    for (v, us) in [("0", 0), ("1000", 1000), ("20", 20)] {
        let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", "--rx-coalesce-us", v]).unwrap();
        assert_eq!(c.rx_coalesce, std::time::Duration::from_micros(us));
    }
    let c = parse(&[
        "--vm",
        "socket=/tmp/x,gid=127.1.0.1",
        "--path-mtu",
        "4096",
        "--ca-ack-delay",
        "10",
    ])
    .unwrap();
    assert_eq!((c.path_mtu, c.ca_ack_delay), (pvcm_wire::abi::MTU_4096, 10));
    for (opt, bad) in [
        ("--path-mtu", "1500"),
        ("--ca-ack-delay", "32"),
        ("--rx-coalesce-us", "1001"),
        ("--rx-coalesce-us", "2ms"),
    ] {
        let e = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1", opt, bad])
            .unwrap_err()
            .to_string();
        assert!(e.contains(opt) && e.contains(bad), "{e}");
    }
}

#[test]
fn socket_access_options() {
    let c = parse(&["--vm", "socket=/tmp/x,gid=127.1.0.1"]).unwrap();
    assert_eq!(c.vm_sockets, SocketAccess::VM_DEFAULT);
    assert_eq!(c.vm_sockets.mode, 0o660);
    assert_eq!(c.control_access.mode, 0o600);
    let c = parse(&[
        "--vm",
        "socket=/tmp/x,gid=127.1.0.1",
        "--socket-owner",
        "root",
        "--socket-group",
        "root",
        "--socket-mode",
        "0o666",
        "--control-group",
        "0",
        "--control-mode",
        "0640",
        "--allow-world-access",
    ])
    .unwrap();
    assert_eq!(
        c.vm_sockets,
        SocketAccess {
            owner: Some(0),
            group: Some(0),
            mode: 0o666
        }
    );
    assert_eq!(
        c.control_access,
        SocketAccess {
            owner: None,
            group: Some(0),
            mode: 0o640
        }
    );
    for (args, want) in [
        (&["--socket-mode", "1777"][..], "at most 0777"),
        (&["--socket-mode", "rw"][..], "--socket-mode"),
        (&["--socket-group", "a:b"][..], "--socket-group"),
        (
            &["--socket-group", "no-such-group-pvcm"][..],
            "no such group",
        ),
        (&["--socket-owner", "no-such-user-pvcm"][..], "no such user"),
        (&["--log-format", "xml"][..], "--log-format"),
        (&["--socket-mode", "0666"][..], "every local user"),
        (&["--control-mode", "0o601"][..], "allow-world-access"),
        (
            &["--socket-mode", "0606", "--allow-world-access=false"][..],
            "socket-mode=0606",
        ),
    ] {
        let mut a = vec!["--vm", "socket=/a,gid=127.0.0.1"];
        a.extend_from_slice(args);
        let e = parse(&a).unwrap_err();
        assert!(e.to_string().contains(want), "{args:?}: {e}");
    }
}

#[test]
fn toml_modes_read_as_operators_write_them() {
    let vm = "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n";
    let mode = |line: &str| {
        let (_d, f) = toml_file(&format!("{line}\n{vm}"));
        parse(&["--config", f.to_str().unwrap()])
    };
    for line in [
        "socket-mode = 0o660",
        "socket-mode = \"0660\"",
        "socket-mode = \"660\"",
        "socket-mode = \"0o660\"",
        "socket-mode = 0o6_60",
    ] {
        let c = mode(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert_eq!(c.vm_sockets.mode, 0o660, "{line}");
    }
    let c = mode("control-mode = 0o600").unwrap();
    assert_eq!(c.control_access.mode, 0o600);
    // An integer that is not an octal literal is refused, and the error says how
    // to write it.
    for line in [
        "socket-mode = 432",
        "socket-mode = 660",
        "control-mode = 0x1b0",
        "control-mode = 600",
    ] {
        let e = mode(line).unwrap_err().to_string();
        let key = line.split(' ').next().unwrap();
        assert!(
            e.contains(key) && e.contains("octal") && e.contains("= 0o660"),
            "{line}: {e}"
        );
    }
    // World access only when allowed, in the file as on the command line.
    let e = mode("socket-mode = 0o666").unwrap_err().to_string();
    assert!(e.contains("allow-world-access"), "{e}");
    let c = mode("socket-mode = 0o666\nallow-world-access = true").unwrap();
    assert_eq!(c.vm_sockets.mode, 0o666);
    assert!(mode("control-mode = \"0602\"\nallow-world-access = false").is_err());
}

/// Each of `texts`' error (as a `backend.toml`), with the file and a clean VM around it.
fn toml_error(text: &str) -> String {
    let (_d, f) = toml_file(text);
    parse(&["--config", f.to_str().unwrap()])
        .unwrap_err()
        .to_string()
}

#[test]
fn unknown_keys_are_refused_naming_the_key_the_file_and_the_line() {
    let vm = "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n";
    // At the top level.
    let e = toml_error(&format!(
        "policy = \"default\"\nrx-backlog-byte = \"1M\"\n{vm}"
    ));
    assert!(
        e.contains("backend.toml: line 2: unknown key \"rx-backlog-byte\" (expected [[vm]] or")
            && e.contains("rx-backlog-bytes"),
        "{e}"
    );
    // In a VM's table: the table and its key, and the keys a VM takes.
    let e = toml_error(&format!(
        "{vm}[[vm]]\nname = \"b\"\nsocket = \"/tmp/b\"\ngid = \"127.0.0.2\"\nqpn-bsae = 16\n"
    ));
    assert!(
        e.contains(
            "backend.toml: line 8: [[vm]] #2 (b): unknown key \"qpn-bsae\" (expected socket,"
        ),
        "{e}"
    );
    // In an inline table of VMs, and a table where none belongs.
    let e = toml_error("vm = [{ socket = \"/tmp/a\", gid = \"127.0.0.1\", colour = 1 }]\n");
    assert!(
        e.contains("line 1: [[vm]] #1: unknown key \"colour\""),
        "{e}"
    );
    let e = toml_error(&format!("{vm}[metrics]\nport = 9791\n"));
    assert!(
        e.contains("metrics: expected a string, an integer or a boolean, found a table"),
        "{e}"
    );
    // The line format refuses them the same way.
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("pvcm.conf");
    std::fs::write(
        &f,
        "vm socket=/tmp/p,gid=127.2.0.1\n\n# a comment\ncolour blue\n",
    )
    .unwrap();
    let e = parse(&["--config", f.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pvcm.conf: line 4: unknown key \"colour\""),
        "{e}"
    );
    std::fs::write(&f, "vm socket=/tmp/p,gid=127.2.0.1,colour=blue\n").unwrap();
    let e = parse(&["--config", f.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("pvcm.conf: line 1: --vm") && e.contains("unknown key \"colour\""),
        "{e}"
    );
}

#[test]
fn a_value_of_the_wrong_type_names_its_key() {
    let vm = "[[vm]]\nsocket = \"/tmp/a\"\ngid = \"127.0.0.1\"\n";
    for (text, want) in [
        (
            format!("bind-port = [4791]\n{vm}"),
            "line 1: bind-port: expected a string, an integer or a boolean, found an array",
        ),
        (
            format!("reconnect-grace = 1.5\n{vm}"),
            "line 1: reconnect-grace: expected a string, an integer or a boolean, found a float",
        ),
        (
            format!("policy = \"default\"\nstate-dir = 1979-05-27\n{vm}"),
            "line 2: state-dir: expected a string, an integer or a boolean, found a date",
        ),
        (
            format!("allow-world-access = \"maybe\"\n{vm}"),
            "line 1: allow-world-access=\"maybe\"",
        ),
        (
            format!("{vm}quota = {{ n = 1 }}\n"),
            "line 4: [[vm]] #1: quota: expected a string, an integer or a boolean, found a table",
        ),
        (
            format!("{vm}incoming = 2\n"),
            "line 4: [[vm]] #1: incoming=\"2\": expected yes or no",
        ),
        (
            "vm = [1]\n".to_string(),
            "line 1: [[vm]] #1: expected a table, found an integer",
        ),
    ] {
        let e = toml_error(&text);
        assert!(
            e.contains("backend.toml") && e.contains(want),
            "{text}: {e}"
        );
    }
}

#[test]
fn the_command_line_overrides_the_file() {
    let (_d, f) = toml_file(TOML);
    let file = parse(&["--config", f.to_str().unwrap()]).unwrap();
    let c = parse(&[
        "--config",
        f.to_str().unwrap(),
        "--policy",
        "mlx4-post2020",
        "--wire-rx",
        "raw",
        "--bind-port",
        "4800",
        "--control",
        "/tmp/other.sock",
        "--rx-backlog-bytes",
        "8M",
        "--reconnect-grace",
        "5",
        "--control-mode",
        "0640",
        "--log-format",
        "text",
    ]);
    // mlx4-post2020 keeps no state: the file's state-dir makes that an error, so the
    // override reached the check.
    assert!(c.unwrap_err().to_string().contains("--state-dir keeps"));
    let c = parse(&[
        "--config",
        f.to_str().unwrap(),
        "--wire-rx",
        "raw",
        "--bind-port",
        "4800",
        "--control",
        "/tmp/other.sock",
        "--rx-backlog-bytes",
        "8M",
        "--reconnect-grace",
        "5",
        "--control-mode",
        "0640",
        "--log-format",
        "text",
    ])
    .unwrap();
    assert_eq!((file.wire_rx, c.wire_rx), (RxMode::Udp, RxMode::Raw));
    assert_eq!((file.bind_port, c.bind_port), (0x12b7, 4800));
    assert_eq!(c.control, Some(PathBuf::from("/tmp/other.sock")));
    assert_eq!(
        (file.rx_backlog_bytes, c.rx_backlog_bytes),
        (4 << 20, 8 << 20)
    );
    assert_eq!(c.reconnect_grace, std::time::Duration::from_secs(5));
    assert_eq!(
        (file.control_access.mode, c.control_access.mode),
        (0o660, 0o640)
    );
    assert_eq!(
        (file.log_format, c.log_format),
        (LogFormat::Json, LogFormat::Text)
    );
    // What the command line does not give stays the file's.
    assert_eq!(c.state_dir, file.state_dir);
    assert_eq!(c.metrics, file.metrics);
    assert_eq!(c.vm_sockets, file.vm_sockets);
    assert_eq!(c.rx_host_backlog_bytes, file.rx_host_backlog_bytes);
    assert_eq!(c.vms, file.vms);
}

#[test]
fn both_file_formats_configure_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let lines = dir.path().join("pvcm.conf");
    std::fs::write(
        &lines,
        "policy default\nport=soft\nwire-rx udp\nbind-port 0x12b7\n\
         control /run/pvcm/control.sock\nmetrics 9791\nrx-backlog-bytes 4M\n\
         rx-host-backlog-bytes 1073741824\nstate-dir /var/lib/pvcm\nreconnect-grace 30\n\
         socket-group 0\nsocket-mode 0640\ncontrol-mode 0660\nlog-format json\n\
         vm name=vm1,socket=/run/pvcm/vm1.sock,gid=::ffff:192.0.2.11,qpn-base=16,\
         qpn-count=0x20000,ca-guid=0x0002c90300a1b2c3,quota=4096\n\
         vm name=vm2,socket=/run/pvcm/vm2.sock,gid=2001:db8::12,id-range=0x80070000/16,\
         quota=32768,incoming=yes\n",
    )
    .unwrap();
    let (_d, toml) = toml_file(TOML);
    let a = parse(&["--config", lines.to_str().unwrap()]).unwrap();
    let b = parse(&["--config", toml.to_str().unwrap()]).unwrap();
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    // A later line wins; a flag alone is true.
    std::fs::write(
        &lines,
        "vm socket=/tmp/p,gid=127.2.0.1\nbind-port 5000\nbind-port 5001\n\
         socket-mode 0666\nallow-world-access\n",
    )
    .unwrap();
    let c = parse(&["--config", lines.to_str().unwrap()]).unwrap();
    assert_eq!(c.bind_port, 5001);
    assert!(c.allow_world_access);
    std::fs::write(&lines, "vm socket=/tmp/p,gid=127.2.0.1\npolicy\n").unwrap();
    let e = parse(&["--config", lines.to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("line 2: policy: a value is required"), "{e}");
}

#[test]
fn the_packaged_example_checks() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/host");
    let c = parse(&[
        "--config",
        dir.join("backend.example.toml").to_str().unwrap(),
    ])
    .unwrap();
    let names: Vec<&str> = c.vms.iter().map(|v| v.vm.name.as_str()).collect();
    assert_eq!(names, ["vm1", "vm2"]);
    assert_eq!(c.vm_sockets.mode, 0o660);
    assert_eq!(c.state_dir, Some(PathBuf::from("/var/lib/pvcm")));
    // The installed file holds no VM: it reads, and says so.
    let e = parse(&["--config", dir.join("backend.toml").to_str().unwrap()]).unwrap_err();
    assert!(matches!(e, ConfigError::NoVm), "{e}");
}

#[test]
fn a_syntax_error_names_its_line() {
    let e = toml_error("policy = \"default\"\n\nbind-port = 47 91\n");
    assert!(e.contains("backend.toml: line 3: "), "{e}");
    assert!(!e.contains('\n'), "one line: {e}");
}

#[test]
fn vm_values_are_taken_without_the_white_space_around_them() {
    let (_d, f) = toml_file(
        "[[vm]]\nsocket = \" /tmp/a \"\ngid = \" 127.0.0.1 \"\nname = \" a \"\n\
         id-range = \" 0x80070000/16 \"\nquota = 100\nincoming = \" yes \"\n",
    );
    let c = parse(&["--config", f.to_str().unwrap()]).unwrap();
    let v = &c.vms[0];
    assert_eq!(
        (v.socket.to_str(), v.vm.name.as_str(), v.incoming),
        (Some("/tmp/a"), "a", true)
    );
    let s: VmSpec = " socket = /tmp/a , gid = 127.0.0.1 , name = a "
        .parse()
        .unwrap();
    assert_eq!(
        (s.socket.to_str(), s.vm.name.as_str()),
        (Some("/tmp/a"), "a")
    );
    // A key and its other name together are the key twice.
    let e = VmSpec::from_str("socket=/a,socket-path=/b,gid=127.0.0.1").unwrap_err();
    assert!(e.to_string().contains("given twice"), "{e}");
    let e = toml_error("[[vm]]\nsocket = \"/a\"\nsocket-path = \"/b\"\ngid = \"127.0.0.1\"\n");
    assert!(e.contains("[[vm]] #1: duplicate field `socket`"), "{e}");
}

#[test]
fn a_vm_takes_several_gids_the_first_its_primary() {
    let s: VmSpec = "socket=/a,gid=10.0.0.5,gid=2001:db8::5,gid=10.0.1.5,name=d"
        .parse()
        .unwrap();
    assert_eq!(s.vm.gid, Gid::from_ipv4(Ipv4Addr::new(10, 0, 0, 5)));
    let more: Vec<String> = s.vm.more_gids.iter().map(|g| g.to_string()).collect();
    assert_eq!(more, ["2001:db8::5", "::ffff:10.0.1.5"]);
    let addrs: Vec<String> = s.addrs().map(|(a, _)| a.to_string()).collect();
    assert_eq!(addrs, ["10.0.0.5", "2001:db8::5", "10.0.1.5"]);
    // The spec gives itself back, the GIDs in order.
    let arg = s.to_arg();
    assert!(
        arg.contains("gid=::ffff:10.0.0.5,gid=2001:db8::5,gid=::ffff:10.0.1.5"),
        "{arg}"
    );
    assert_eq!(arg.parse::<VmSpec>().unwrap(), s);
    // A link-local primary keeps its interface; further GIDs follow it.
    let ll: VmSpec = "socket=/b,gid=fe80::5%br0,gid=2001:db8::6".parse().unwrap();
    assert_eq!(ll.iface.as_deref(), Some("br0"));
    assert_eq!(ll.to_arg().parse::<VmSpec>().unwrap(), ll);
    // A one-GID VM is what it always was.
    let one: VmSpec = "socket=/c,gid=10.0.0.7".parse().unwrap();
    assert!(one.vm.more_gids.is_empty());
    assert_eq!(one.to_arg().matches("gid=").count(), 1);
    // The state directory's vms.toml form (an array when there are several).
    let t = toml::to_string(&toml::Table::from_iter([(
        "vm".to_string(),
        toml_vms(&[s.clone(), one.clone()]),
    )]))
    .unwrap();
    assert!(
        t.contains("gid = [\"::ffff:10.0.0.5\", \"2001:db8::5\""),
        "{t}"
    );
    let doc = toml::de::DeTable::parse(&t).unwrap();
    let back = vm_tables(doc.get_ref().get("vm").unwrap()).unwrap();
    assert_eq!(back, vec![s, one]);
}

#[test]
fn a_config_file_gives_gid_as_a_string_or_an_array() {
    let (_d, f) = toml_file(
        "[[vm]]\nsocket = \"/tmp/a\"\ngid = [\"10.0.0.5\", \"2001:db8::5\"]\nname = \"a\"\n\
         [[vm]]\nsocket = \"/tmp/b\"\ngid = \"10.0.0.6\"\nname = \"b\"\n",
    );
    let c = parse(&["--config", f.to_str().unwrap()]).unwrap();
    assert_eq!(c.vms[0].vm.more_gids, vec!["2001:db8::5".parse().unwrap()]);
    assert!(c.vms[1].vm.more_gids.is_empty());
    let summary = c.summary();
    assert!(
        summary.contains("gid ::ffff:10.0.0.5 2001:db8::5,"),
        "{summary}"
    );
    for (gid, want) in [
        ("[]", "gid=GID is required"),
        ("[\"10.0.0.5\", 7]", "a GID (a string) or an array of GIDs"),
        ("[\"10.0.0.5\", \"banana\"]", "not a GID"),
        ("[\"10.0.0.5\", \"10.0.0.5\"]", "given twice"),
    ] {
        let e = toml_error(&format!("[[vm]]\nsocket = \"/tmp/a\"\ngid = {gid}\n"));
        assert!(e.contains(want), "{gid}: {e}");
    }
}

#[test]
fn several_gids_are_checked_each_and_together() {
    let many: String = (1..=11).map(|i| format!(",gid=10.0.0.{i}")).collect();
    for (s, want) in [
        ("socket=/a,gid=10.0.0.5,gid=10.0.0.5", "given twice"),
        ("socket=/a,gid=10.0.0.5,gid=::ffff:10.0.0.5", "given twice"),
        (
            "socket=/a,gid=10.0.0.5,gid=2001:db8::5,gid=2001:db8::5",
            "given twice",
        ),
        (
            "socket=/a,gid=10.0.0.5,gid=fe80::5%br0",
            "only be a VM's first",
        ),
        ("socket=/a,gid=10.0.0.5,gid=224.0.0.1", "multicast"),
        ("socket=/a,gid=10.0.0.5,gid=banana", "not a GID"),
        (&format!("socket=/a{many}"), "11 GIDs: a VM has at most 10"),
    ] {
        let e = VmSpec::from_str(s).unwrap_err();
        assert!(e.to_string().contains(want), "{s}: {e}");
    }
    let ten: String = (1..=10).map(|i| format!(",gid=10.0.0.{i}")).collect();
    assert!(VmSpec::from_str(&format!("socket=/a{ten}")).is_ok());
    // Two VMs holding one GID, whichever of theirs it is.
    let a: VmSpec = "socket=/a,gid=10.0.0.5,gid=2001:db8::5,name=a"
        .parse()
        .unwrap();
    let b: VmSpec = "socket=/b,gid=10.0.0.6,gid=2001:db8::5,name=b"
        .parse()
        .unwrap();
    let c: VmSpec = "socket=/c,gid=2001:db8::5,name=c".parse().unwrap();
    for other in [&b, &c] {
        let e = check_vm_set(&[a.clone(), other.clone()], None).unwrap_err();
        assert!(
            e.to_string()
                .contains("two VMs use GID 2001:db8::5: VM \"a\""),
            "{e}"
        );
    }
    let d: VmSpec = "socket=/d,gid=10.0.0.7,gid=2001:db8::7,name=d"
        .parse()
        .unwrap();
    assert!(check_vm_set(&[a, d], None).is_ok());
}
