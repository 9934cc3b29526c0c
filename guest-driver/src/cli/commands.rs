//! `listen`, `connect` and `cmtime`, written once over [`Route`]: the same lines (text
//! and `--json`) and exit statuses whichever way the CM is reached.

use std::collections::VecDeque;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::json;

use super::route::{Answer, ConnectArgs, Route, RouteEvent};
use super::{CmtimePlan, EXIT_CM_FAILED, ProcessCpu, Report};
use crate::cm::rdma_cm::tcp_service_id;
use crate::device::DeviceEvent;
use crate::device::cmtime::{ClientOptions, Failure, ServerOptions};
use crate::report::{cmtime_report_json, failure_json, ms, server_report_json, with};

/// What `listen` was asked.
#[derive(Debug, Clone, Copy)]
pub struct ListenArgs<'a> {
    /// The port.
    pub port: u16,
    /// Connections to see torn down before exiting (`None`: never exit).
    pub count: Option<u32>,
    /// Private data for the REP (or the REJ).
    pub data: &'a str,
    /// Reject every request.
    pub reject: bool,
    /// Destroy a connection the peer disconnected only this long after the event.
    pub react_after: Duration,
}

/// The line of a device event.
pub(crate) fn device_event(rep: &mut dyn Report, e: &DeviceEvent) {
    rep.line(
        format!("device: {e}"),
        json!({"event": "device", "what": e.to_string()}),
    );
}

/// Waits up to `timeout` for the first event about `id` that `pick` accepts, printing
/// device events (`None` after a device reset too).
pub fn wait_for<R: Route + ?Sized>(
    route: &mut R,
    rep: &mut dyn Report,
    id: R::Id,
    timeout: Duration,
    pick: impl Fn(&RouteEvent<R::Id>) -> bool,
) -> Result<Option<RouteEvent<R::Id>>, R::Error> {
    let until = route.now().after(timeout);
    loop {
        match route.next(until)? {
            None => return Ok(None),
            Some(RouteEvent::Device(e)) => {
                device_event(rep, &e);
                if e == DeviceEvent::Reset {
                    return Ok(None);
                }
            }
            Some(ev) if ev.id() == Some(id) && pick(&ev) => return Ok(Some(ev)),
            Some(_) => {}
        }
    }
}

/// `listen`: accepts (or rejects) connections on a port and prints their events until
/// `count` of them were torn down.
pub fn listen<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    a: &ListenArgs<'_>,
) -> Result<ExitCode, R::Error> {
    let port = a.port;
    let sid = tcp_service_id(port);
    let mut lid = route.listen(port)?;
    let gid = route.gid();
    rep.line(
        format!("listening on {gid} port {port} (service id {sid:#018x})"),
        json!({"event": "listening", "gid": gid.to_string(), "port": port, "service_id": format!("{sid:#018x}")}),
    );
    let reply = a.data.as_bytes();
    // Connections the peer ended, destroyed by the "application" at these instants.
    let mut late = VecDeque::new();
    let mut done = 0u32;
    loop {
        done += destroy_late(route, rep, &mut late, a.react_after)?;
        if a.count.is_some_and(|c| done >= c) {
            route.stop_listening(lid)?;
            return Ok(ExitCode::SUCCESS);
        }
        let until = late.front().map_or_else(
            || route.now().after(Duration::from_secs(3600)),
            |&(at, _)| at,
        );
        let Some(e) = route.next(until)? else {
            continue;
        };
        match e {
            RouteEvent::Device(e) => {
                device_event(rep, &e);
                if e == DeviceEvent::Reset {
                    lid = route.listen(port)?;
                }
            }
            RouteEvent::ConnectRequest {
                id,
                listen_id,
                remote_gid,
                remote_qpn,
                data,
            } if listen_id.is_none_or(|l| l == lid) => {
                rep.line(
                    format!("{id}: request from {remote_gid} qpn {remote_qpn:#x} data {data:?}"),
                    json!({"event": "connect_request", "id": id.to_string(), "remote_gid": remote_gid, "remote_qpn": remote_qpn, "data": data}),
                );
                done += answer(route, rep, id, reply, a.reject)?;
            }
            RouteEvent::Established { id, remote_qpn, .. } => rep.line(
                format!("{id}: established (remote qpn {remote_qpn:#x})"),
                json!({"event": "established", "id": id.to_string(), "remote_qpn": remote_qpn}),
            ),
            RouteEvent::Disconnected { id } => {
                rep.line(
                    format!("{id}: disconnected"),
                    json!({"event": "disconnected", "id": id.to_string()}),
                );
                if a.react_after.is_zero() {
                    // The CM keeps the comm ID through TimeWait.
                    route.destroy(id)?;
                    done += 1;
                } else {
                    late.push_back((route.now().after(a.react_after), id));
                }
            }
            RouteEvent::Rejected { id, reason } => {
                route.destroy(id)?;
                done += 1;
                rep.line(
                    format!("{id}: rejected by the peer: REJ reason {reason}"),
                    with(
                        json!({"event": "rejected", "id": id.to_string()}),
                        failure_json(Failure::Rejected(reason)),
                    ),
                );
            }
            RouteEvent::Unreachable { id } => {
                route.destroy(id)?;
                done += 1;
                rep.line(
                    format!("{id}: unreachable"),
                    json!({"event": "unreachable", "id": id.to_string()}),
                );
            }
            RouteEvent::ConnectRequest { .. } | RouteEvent::Other { .. } => {}
        }
    }
}

/// Destroys the connections whose late reaction is due; how many.
fn destroy_late<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    late: &mut VecDeque<(crate::time::Time, R::Id)>,
    react_after: Duration,
) -> Result<u32, R::Error> {
    let mut n = 0;
    while let Some(&(at, id)) = late.front() {
        if route.now() < at {
            break;
        }
        late.pop_front();
        route.destroy(id)?;
        n += 1;
        rep.line(
            format!(
                "{id}: destroyed {:.1} s after the peer disconnected",
                react_after.as_secs_f64()
            ),
            json!({"event": "destroyed_late", "id": id.to_string(), "secs": react_after.as_secs_f64()}),
        );
    }
    Ok(n)
}

/// Answers a connection request; the connections it ended (0 or 1).
fn answer<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    id: R::Id,
    reply: &[u8],
    reject: bool,
) -> Result<u32, R::Error> {
    // The peer may have withdrawn the request already (e.g. rdma_connect() then
    // rdma_destroy_id(): its REJ(TIMEOUT) arrived in the same batch), so answering late
    // is not an error.
    let answered = if reject {
        route.reject(id, reply)?
    } else {
        route.accept(id, reply)?
    };
    match answered {
        Answer::Sent if reject => {
            route.destroy(id)?;
            rep.line(
                format!("{id}: rejected"),
                json!({"event": "rejected_by_us", "id": id.to_string()}),
            );
            Ok(0)
        }
        Answer::Sent => Ok(0),
        Answer::Withdrawn { why, state, ended } => {
            rep.line(
                format!("{id}: request withdrawn before we answered ({why})"),
                json!({"event": "withdrawn", "id": id.to_string(), "state": state}),
            );
            if ended {
                route.destroy(id)?;
                return Ok(1);
            }
            Ok(0)
        }
    }
}

/// `connect`: connects, reports, holds, disconnects and destroys.
pub fn connect<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    a: &ConnectArgs<'_>,
) -> Result<ExitCode, R::Error> {
    let (dest, port, timeout) = (a.dest, a.port, a.timeout);
    let t0 = route.now();
    let (id, outcome) = route.connect(rep, a)?;
    let took = ms(route.now().since(t0));
    let c = match outcome {
        Ok(c) => c,
        Err(f) => {
            let text = match f {
                Failure::Rejected(r) => {
                    format!("{id}: failed: rejected by {dest}: REJ reason {r} after {took} ms")
                }
                Failure::Unreachable => format!(
                    "{id}: failed: {dest} unreachable (no answer to any retry) after {took} ms"
                ),
                _ => format!(
                    "{id}: failed: timeout: no answer within {timeout:?}; destroying (REJ timeout)"
                ),
            };
            // The event names scripts know: rejected / unreachable / timeout.
            rep.line(
                text,
                with(
                    json!({"event": f.kind(), "id": id.to_string(), "dest": dest.to_string(), "port": port, "ms": took}),
                    failure_json(f),
                ),
            );
            route.abandon(id)?;
            return Ok(ExitCode::from(EXIT_CM_FAILED));
        }
    };
    let (sport, qpn, text) = (c.src_port, c.remote_qpn, c.data);
    rep.line(
        format!("{id}: established to {dest} port {port} from port {sport} in {took} ms (remote qpn {qpn:#x}, data {text:?})"),
        json!({"event": "established", "id": id.to_string(), "dest": dest.to_string(), "port": port, "src_port": sport, "ms": took, "remote_qpn": qpn, "data": text}),
    );
    let code = disconnect(route, rep, id, a)?;
    route.destroy(id)?;
    route.flush()?;
    rep.line(
        format!("{id}: destroyed"),
        json!({"event": "destroyed", "id": id.to_string()}),
    );
    Ok(code)
}

/// `connect`'s teardown: holds the connection (watching for the peer's DREQ), then
/// disconnects it unless the peer did; a DREP that does not come is a failure.
fn disconnect<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    id: R::Id,
    a: &ConnectArgs<'_>,
) -> Result<ExitCode, R::Error> {
    let disconnected = |e: &RouteEvent<R::Id>| matches!(e, RouteEvent::Disconnected { .. });
    let peer_left = wait_for(route, rep, id, a.hold, disconnected)?.is_some();
    let t1 = route.now();
    route.disconnect(id)?;
    if peer_left {
        rep.line(
            format!("{id}: disconnected by the peer"),
            json!({"event": "disconnected", "by": "peer", "id": id.to_string()}),
        );
        return Ok(ExitCode::SUCCESS);
    }
    let got = wait_for(route, rep, id, a.timeout, disconnected)?;
    let took = ms(route.now().since(t1));
    if got.is_some() {
        rep.line(
            format!("{id}: disconnected in {took} ms"),
            json!({"event": "disconnected", "by": "us", "id": id.to_string(), "ms": took, "drep": true}),
        );
        return Ok(ExitCode::SUCCESS);
    }
    // A teardown that timed out is a failure too.
    rep.line(
        format!(
            "{id}: failed: disconnect_timeout: no DREP within {:?}",
            a.timeout
        ),
        with(
            json!({"event": "disconnected", "by": "us", "id": id.to_string(), "ms": took, "drep": false}),
            failure_json(Failure::DisconnectTimeout),
        ),
    );
    Ok(ExitCode::from(EXIT_CM_FAILED))
}

/// `cmtime`: the client's rounds or the server.
pub fn cmtime<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    plan: &CmtimePlan,
) -> Result<ExitCode, R::Error> {
    let ok = match plan {
        CmtimePlan::Client {
            opts,
            rounds,
            pause,
        } => {
            let rounds = *rounds;
            let mut ok = true;
            for round in 1..=rounds {
                if rounds > 1 {
                    if round > 1 {
                        route.pause(*pause)?;
                    }
                    rep.line(
                        format!("round {round} of {rounds}"),
                        json!({"event": "round", "round": round, "rounds": rounds}),
                    );
                }
                ok &= cmtime_client_round(route, rep, opts)?;
            }
            ok
        }
        CmtimePlan::Server(o) => cmtime_server(route, rep, o)?,
    };
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(EXIT_CM_FAILED)
    })
}

/// One client burst: runs it and prints its report, CPU and the route's work; true if
/// every connection was established and torn down.
fn cmtime_client_round<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    o: &ClientOptions,
) -> Result<bool, R::Error> {
    let mark = route.mark(false)?;
    let cpu0 = ProcessCpu::now();
    let r = route.cmtime_client(o)?;
    let cpu = ProcessCpu::now().since(cpu0);
    rep.line(r.to_string(), cmtime_report_json(&r));
    let (text, v) = cpu.report();
    rep.line(text, v);
    let (text, v) = route.work(mark)?;
    rep.line(text, v);
    Ok(r.success())
}

/// The server: serves `o.connections`, prints its report, CPU and the route's work;
/// true if every one was torn down.
fn cmtime_server<R: Route>(
    route: &mut R,
    rep: &mut dyn Report,
    o: &ServerOptions,
) -> Result<bool, R::Error> {
    let gid = route.gid();
    rep.line(
        format!(
            "cmtime server on {gid} port {} for {} connections",
            o.port, o.connections
        ),
        json!({"event": "listening", "gid": gid.to_string(), "port": o.port, "connections": o.connections}),
    );
    let mark = route.mark(true)?;
    let cpu0 = ProcessCpu::now();
    let r = route.cmtime_server(o)?;
    let cpu = ProcessCpu::now().since(cpu0);
    rep.line(r.to_string(), server_report_json(&r));
    let (text, v) = cpu.report();
    rep.line(text, v);
    let (text, v) = route.work(mark)?;
    rep.line(text, v);
    Ok(r.disconnected >= o.connections)
}
