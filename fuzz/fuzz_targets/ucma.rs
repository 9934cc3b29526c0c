//! The guest service's rdma_cm layer (`guest-driver/src/service/cma.rs`) under the
//! commands processes write, decoded from the input: well-formed commands with chosen
//! fields (ids of this file, of another file or never issued; response addresses in
//! mapped memory, straddling its end or unmapped), arbitrary bytes, files opened and
//! released, MADs exchanged with a second service, clock steps.
//!
//! Checked: no panic; every answer is 0, an errno, a blocked GET_EVENT or a migration;
//! a command naming another file's id never succeeds (EINVAL), nor one naming an id
//! never issued (ENOENT); responses are written only into mapped memory (the fake
//! address space refuses the rest); and quiesce: after every file is released and the
//! clock runs past every retry and TimeWait with the wire still carrying MADs, both
//! services hold no id and both agents no connection, comm ID, timer or unsent MAD.

#![no_main]
#![allow(clippy::unwrap_used, dead_code)]

#[path = "../../guest-driver/tests/service_support.rs"]
mod support;

use std::net::SocketAddr;
use std::time::Duration;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use pvcm_guest::service::abi::{
    self, CmdHdr, ConnParam, cmd, emit_sockaddr, ps, put_u16, put_u32, put_u64,
};
use pvcm_guest::service::cma::{Env, Fh, Outcome, errno};
use support::*;

#[derive(Debug, Clone, Copy, Arbitrary)]
enum IdSel {
    /// One of this file's ids (by index).
    Mine(u8),
    /// One of another file's ids.
    Theirs(u8),
    /// A number nobody was given.
    Never(u16),
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Addr {
    /// The mapped response area.
    Good,
    /// Straddling its end.
    Edge,
    /// Unmapped.
    Bad,
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Open { vm: bool },
    Release { vm: bool, file: u8 },
    CreateId { vm: bool, file: u8, uid: u64, ps: u8, addr: Addr },
    Destroy { vm: bool, file: u8, id: IdSel, addr: Addr },
    Bind { vm: bool, file: u8, id: IdSel, port: u16, ours: bool, v6: bool },
    Resolve { vm: bool, file: u8, id: IdSel, port: u16, peer: bool },
    Route { vm: bool, file: u8, id: IdSel },
    Listen { vm: bool, file: u8, id: IdSel, backlog: u32 },
    Connect { vm: bool, file: u8, id: IdSel, qpn: u32, pd: u8, valid: bool },
    Accept { vm: bool, file: u8, id: IdSel, qpn: u32, pd: u8, valid: bool, uid: u64 },
    Reject { vm: bool, file: u8, id: IdSel, reason: u8, pd: u8 },
    Disconnect { vm: bool, file: u8, id: IdSel },
    InitQp { vm: bool, file: u8, id: IdSel, state: u8, addr: Addr, out: u16 },
    QueryRoute { vm: bool, file: u8, id: IdSel, addr: Addr, out: u16 },
    Query { vm: bool, file: u8, id: IdSel, option: u8, addr: Addr, out: u16 },
    GetEvent { vm: bool, file: u8, addr: Addr, out: u16 },
    SetOption { vm: bool, file: u8, id: IdSel, level: u8, name: u8, len: u8, addr: Addr },
    Notify { vm: bool, file: u8, id: IdSel, event: u8 },
    Migrate { vm: bool, to: u8, from: u8, id: IdSel, addr: Addr },
    Raw { vm: bool, file: u8, bytes: Vec<u8> },
    Exchange,
    Tick { ms: u16 },
}

struct World {
    vms: [Vm; 2],
    /// Per VM: open files and, per file, the ids it created (as reported).
    files: [Vec<(Fh, Vec<u32>)>; 2],
}

impl World {
    fn file(&self, vm: usize, f: u8) -> Option<Fh> {
        let v = &self.files[vm];
        (!v.is_empty()).then(|| v[usize::from(f) % v.len()].0)
    }

    /// The id `sel` names for file `fh` of `vm`, and what it must answer if refused
    /// for not being the file's (EINVAL) or not existing (ENOENT).
    fn id(&self, vm: usize, fh: Fh, sel: IdSel) -> (u32, Option<i32>) {
        let v = &self.files[vm];
        match sel {
            IdSel::Mine(i) => match v.iter().find(|(f, _)| *f == fh) {
                Some((_, ids)) if !ids.is_empty() => (ids[usize::from(i) % ids.len()], None),
                _ => (u32::from(i) + 5000, None),
            },
            IdSel::Theirs(i) => {
                let others: Vec<u32> = v
                    .iter()
                    .filter(|(f, _)| *f != fh)
                    .flat_map(|(_, ids)| ids.iter().copied())
                    .filter(|id| self.vms[vm].cma_owner(*id).is_some_and(|o| o != fh))
                    .collect();
                if others.is_empty() {
                    (u32::from(i) + 5000, None)
                } else {
                    (others[usize::from(i) % others.len()], Some(errno::EINVAL))
                }
            }
            IdSel::Never(n) => {
                let id = u32::from(n) + 100_000;
                (id, Some(errno::ENOENT))
            }
        }
    }
}

fn addr(a: Addr) -> u64 {
    match a {
        Addr::Good => RESP,
        Addr::Edge => RESP + 4096 - 8,
        Addr::Bad => 0x7000_0000,
    }
}

fn vm_idx(vm: bool) -> usize {
    usize::from(vm)
}

fn sockaddr(ip: &str, port: u16) -> SocketAddr {
    SocketAddr::new(ip.parse().unwrap(), port)
}

fn check(o: &Outcome, must_fail: Option<i32>, what: &str) {
    if let (Some(e), Outcome::Done(r)) = (must_fail, o) {
        assert_eq!(*r, Err(e), "{what}: another file's or an unknown id");
    }
    if let (Some(_), Outcome::WaitEvent { .. }) = (must_fail, o) {
        panic!("{what}: blocked on a foreign id");
    }
}

fuzz_target!(|ops: Vec<Op>| {
    let mut w = World {
        vms: [Vm::new(11), Vm::new(12)],
        files: [Vec::new(), Vec::new()],
    };
    for op in ops.into_iter().take(400) {
        step(&mut w, op);
    }
    // Quiesce: every file goes, the clock runs out every timer, the wire still works.
    for vm in 0..2 {
        for (fh, _) in std::mem::take(&mut w.files[vm]) {
            let v = &mut w.vms[vm];
            let mut env = Env {
                agent: &mut v.agent,
                now: v.now,
            };
            v.cma.release(fh, &mut env);
        }
    }
    for _ in 0..200 {
        for v in &mut w.vms {
            v.now = v.now.after(Duration::from_secs(5));
            v.agent.poll(v.now);
        }
        let [a, b] = &mut w.vms;
        exchange(a, b);
    }
    for (i, v) in w.vms.iter_mut().enumerate() {
        assert_eq!(v.cma.ids(), 0, "vm {i}: ids left after release");
        assert_eq!(v.cma.files(), 0, "vm {i}: files left");
        assert_eq!(v.agent.connection_count(), 0, "vm {i}: connections left");
        assert_eq!(v.agent.comm_ids_held(), 0, "vm {i}: comm IDs left");
        assert_eq!(v.agent.outbox_len(), 0, "vm {i}: MADs left");
        assert!(v.agent.is_quiescent(), "vm {i}: agent not quiescent");
    }
});

fn step(w: &mut World, op: Op) {
    use Op::*;
    match op {
        Open { vm } => {
            let i = vm_idx(vm);
            if w.files[i].len() < 6 {
                let fh = w.vms[i].cma.open();
                w.files[i].push((fh, Vec::new()));
            }
        }
        Release { vm, file } => {
            let i = vm_idx(vm);
            if w.files[i].is_empty() {
                return;
            }
            let k = usize::from(file) % w.files[i].len();
            let (fh, _) = w.files[i].remove(k);
            let v = &mut w.vms[i];
            let mut env = Env {
                agent: &mut v.agent,
                now: v.now,
            };
            v.cma.release(fh, &mut env);
        }
        CreateId { vm, file, uid, ps: p, addr: a } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let space = [ps::TCP, ps::UDP, ps::IB, ps::IPOIB, 0x4242][usize::from(p) % 5];
            let mut b = [0u8; 24];
            put_u64(&mut b, 0, uid | 1);
            put_u64(&mut b, 8, addr(a));
            put_u16(&mut b, 16, space);
            let o = w.vms[i].write(fh, cmd::CREATE_ID, &b, 4);
            if o == Outcome::Done(Ok(())) {
                let id = w.vms[i].mem.get(addr(a), 4).map(|b| abi::u32_at(b, 0));
                if let (Some(id), Some(f)) =
                    (id, w.files[i].iter_mut().find(|(f, _)| *f == fh))
                {
                    f.1.push(id);
                }
            }
        }
        Destroy { vm, file, id, addr: a } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let mut b = [0u8; 16];
            put_u64(&mut b, 0, addr(a));
            put_u32(&mut b, 8, id);
            let o = w.vms[i].write(fh, cmd::DESTROY_ID, &b, 4);
            check(&o, fail, "destroy");
            if o == Outcome::Done(Ok(())) || o == Outcome::Done(Err(errno::EFAULT)) {
                for (_, ids) in &mut w.files[i] {
                    ids.retain(|x| *x != id || w.vms[i].cma_owner(id).is_some());
                }
            }
        }
        Bind { vm, file, id, port, ours, v6 } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let ip = match (ours, v6) {
                (true, false) => format!("10.99.0.{}", 11 + i),
                (false, false) => "0.0.0.0".into(),
                (_, true) => "::".into(),
            };
            let mut b = [0u8; 40];
            emit_sockaddr(&sockaddr(&ip, port % 64 + 7000), &mut b[8..36]);
            put_u32(&mut b, 36, id);
            let o = w.vms[i].write(fh, cmd::BIND_IP, &b, 0);
            check(&o, fail, "bind");
        }
        Resolve { vm, file, id, port, peer } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let dst = if peer {
                format!("10.99.0.{}", 12 - i)
            } else {
                "10.99.0.99".into()
            };
            let mut b = [0u8; 64];
            emit_sockaddr(&sockaddr(&dst, port % 64 + 7000), &mut b[28..56]);
            put_u32(&mut b, 56, id);
            let o = w.vms[i].write(fh, cmd::RESOLVE_IP, &b, 0);
            check(&o, fail, "resolve");
        }
        Route { vm, file, id } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = w.vms[i].id_arg(fh, cmd::RESOLVE_ROUTE, id, 0);
            check(&o, fail, "route");
        }
        Listen { vm, file, id, backlog } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = w.vms[i].id_arg(fh, cmd::LISTEN, id, backlog % 8);
            check(&o, fail, "listen");
        }
        Connect { vm, file, id, qpn, pd, valid } | Accept { vm, file, id, qpn, pd, valid, .. } => {
            let c = if matches!(op, Connect { .. }) {
                cmd::CONNECT
            } else {
                cmd::ACCEPT
            };
            let uid = match op {
                Accept { uid, .. } => uid,
                _ => 0,
            };
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let mut b = vec![0u8; if c == cmd::ACCEPT { 296 } else { 288 }];
            let off = if c == cmd::ACCEPT { 8 } else { 0 };
            ConnParam {
                qp_num: 16 + qpn % 0x1000,
                qkey: 0,
                private_data: vec![7; usize::from(pd)],
                srq: false,
                responder_resources: 1,
                initiator_depth: 1,
                flow_control: false,
                retry_count: 7,
                rnr_retry_count: 7,
                valid,
            }
            .emit(&mut b[off..off + 272]);
            if c == cmd::ACCEPT {
                put_u64(&mut b, 0, uid);
                put_u32(&mut b, 280, id);
            } else {
                put_u32(&mut b, 272, id);
            }
            let o = w.vms[i].write(fh, c, &b, 0);
            // CONNECT refuses parameters marked invalid before it looks at the id.
            let fail = if c == cmd::CONNECT && !valid {
                Some(errno::EINVAL)
            } else {
                fail
            };
            check(&o, fail, "connect/accept");
        }
        Reject { vm, file, id, reason, pd } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let mut b = [0u8; 264];
            put_u32(&mut b, 0, id);
            b[4] = pd;
            b[5] = [0, 28, 35, reason][usize::from(reason) % 4];
            let o = w.vms[i].write(fh, cmd::REJECT, &b, 0);
            // A reason other than CONSUMER_DEFINED (0 stands for it) or
            // VENDOR_OPTION_NOT_SUPPORTED is refused before the id is looked at.
            let fail = if matches!(b[5], 0 | 28 | 35) {
                fail
            } else {
                Some(errno::EINVAL)
            };
            check(&o, fail, "reject");
        }
        Disconnect { vm, file, id } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = w.vms[i].write(fh, cmd::DISCONNECT, &id.to_le_bytes(), 0);
            check(&o, fail, "disconnect");
        }
        InitQp { vm, file, id, state, addr: a, out } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = resp_cmd(&mut w.vms[i], fh, cmd::INIT_QP_ATTR, id, u32::from(state % 8), a, out);
            check(&o, fail.filter(|_| out >= 144 && state <= 6), "init_qp_attr");
        }
        QueryRoute { vm, file, id, addr: a, out } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = resp_cmd(&mut w.vms[i], fh, cmd::QUERY_ROUTE, id, 0, a, out);
            check(&o, fail.filter(|_| out >= 200), "query_route");
        }
        Query { vm, file, id, option, addr: a, out } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = resp_cmd(&mut w.vms[i], fh, cmd::QUERY, id, u32::from(option % 4), a, out);
            let _ = (o, fail);
        }
        GetEvent { vm, file, addr: a, out } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let mut b = [0u8; 8];
            put_u64(&mut b, 0, addr(a));
            let _ = w.vms[i].write(fh, cmd::GET_EVENT, &b, out.max(300));
        }
        SetOption { vm, file, id, level, name, len, addr: a } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let mut b = [0u8; 24];
            put_u64(&mut b, 0, addr(a));
            put_u32(&mut b, 8, id);
            put_u32(&mut b, 12, u32::from(level % 3));
            put_u32(&mut b, 16, u32::from(name % 5));
            put_u32(&mut b, 20, u32::from(len % 9));
            let o = w.vms[i].write(fh, cmd::SET_OPTION, &b, 0);
            check(&o, fail, "set_option");
        }
        Notify { vm, file, id, event } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let (id, fail) = w.id(i, fh, id);
            let o = w.vms[i].id_arg(fh, cmd::NOTIFY, id, u32::from(event % 8));
            check(&o, fail, "notify");
        }
        Migrate { vm, to, from, id, addr: a } => {
            let i = vm_idx(vm);
            let (Some(to), Some(from)) = (w.file(i, to), w.file(i, from)) else {
                return;
            };
            let (id, _) = w.id(i, from, id);
            let v = &mut w.vms[i];
            let r = v.cma.migrate(to, from, id, addr(a), &mut v.mem);
            if r.is_ok() || r == Err(errno::EFAULT) {
                let mut moved = false;
                for (f, ids) in &mut w.files[i] {
                    if *f == from && ids.contains(&id) {
                        ids.retain(|x| *x != id);
                        moved = true;
                    }
                }
                if moved && let Some((_, ids)) = w.files[i].iter_mut().find(|(f, _)| *f == to) {
                    ids.push(id);
                }
            }
        }
        Raw { vm, file, bytes } => {
            let i = vm_idx(vm);
            let Some(fh) = w.file(i, file) else { return };
            let v = &mut w.vms[i];
            let mut env = Env {
                agent: &mut v.agent,
                now: v.now,
            };
            let _ = v.cma.write(fh, ROOT, &bytes, &mut v.mem, &mut env);
            let _ = CmdHdr::parse(&bytes);
        }
        Exchange => {
            let [a, b] = &mut w.vms;
            exchange(a, b);
        }
        Tick { ms } => {
            for v in &mut w.vms {
                v.now = v.now.after(Duration::from_millis(u64::from(ms)));
                v.agent.poll(v.now);
                v.events_from_agent();
            }
        }
    }
}

fn resp_cmd(v: &mut Vm, fh: Fh, c: u32, id: u32, arg: u32, a: Addr, out: u16) -> Outcome {
    let mut b = [0u8; 16];
    put_u64(&mut b, 0, addr(a));
    put_u32(&mut b, 8, id);
    put_u32(&mut b, 12, arg);
    v.write(fh, c, &b, out)
}
