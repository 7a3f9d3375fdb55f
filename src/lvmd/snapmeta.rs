//! CSI's SnapshotMetadata from a thin pool: the blocks a snapshot maps
//! (GetMetadataAllocated) and the blocks two snapshots of one volume map
//! differently (GetMetadataDelta), read from a metadata snapshot of the pool
//! (`reserve_metadata_snap`), as thin_delta -m reads a live kernel pool, so
//! the pool serves I/O meanwhile. The pool's mapping trees are the record: a
//! delta after a crash and restart is as exact as before it. CSI's Identity
//! service is on the same socket, as a CSI driver's socket has it.

use super::csi::identity_server::IdentityServer;
use super::csi::snapshot_metadata_server::{SnapshotMetadata, SnapshotMetadataServer};
use super::csi::{self, BlockMetadata, BlockMetadataType};
use super::service::Shared;
use super::{Error, Lvmd};
use crate::thin::delta::{changed_runs, delta, Delta, DeltaOptions, Side};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Tuples per message when the request leaves it to us.
const DEFAULT_RESULTS: usize = 1024;
/// The most tuples one message carries, whatever is asked (gRPC's 4 MiB
/// message limit holds ~200 K of them).
const MAX_RESULTS: usize = 65536;

/// A volume's blocks as byte ranges, in order, not overlapping.
struct Ranges {
    capacity: u64,
    block_bytes: u64,
    /// (first block, blocks)
    runs: Vec<(u64, u64)>,
}

/// The marker lvmd keeps while it holds POOL's metadata snapshot.
pub(super) fn metadata_snap_marker(pool: &str) -> String {
    format!(".metadata-snap.{pool}.held")
}

impl Lvmd {
    /// Mapped ranges of thin device `right`, or (with `left`) the ranges where
    /// `left` and `right` map differently, from a metadata snapshot of `pool`.
    fn thin_ranges(
        &mut self,
        pool: &str,
        left: Option<u64>,
        right: u64,
    ) -> Result<(u64, Vec<(u64, u64)>), Error> {
        let (meta, _) = self.dm.pool_table(pool)?;
        let path = std::path::Path::new(&meta);
        if !path.is_absolute() || !path.exists() {
            return Err(Error::Unimplemented(format!(
                "{pool}: its metadata device {meta} is not a file or block device lvmd can read"
            )));
        }
        // marked first: a lvmd stopped while it holds the pool's metadata
        // snapshot releases it at its next start (`Lvmd::recover`)
        let marker = metadata_snap_marker(pool);
        self.store.mark(&marker, true)?;
        self.dm.message(pool, "reserve_metadata_snap")?;
        self.step();
        let r = (|| {
            let dev = crate::pdata::FileDev::open(path, false).map_err(|e| format!("{meta}: {e}"))?;
            let mut tm = crate::pdata::tm::reader(Box::new(dev), 256);
            let o = DeltaOptions {
                left: Some(Side::Thin(left.unwrap_or(right))),
                right: Some(Side::Thin(right)),
                verbose: false,
                metadata_snap: true,
            };
            let reading = |e| format!("{pool}: reading its metadata snapshot: {e}");
            if left.is_some() {
                // what the two snapshots share is not read
                let (block, runs) = changed_runs(&mut tm, &o, 0, usize::MAX).map_err(reading)?;
                return Ok((u64::from(block) * 512, runs));
            }
            let rep = delta(&mut tm, &o).map_err(reading)?;
            let mut runs: Vec<(u64, u64)> = Vec::new();
            for r in rep.ranges.iter().filter(|r| r.kind == Delta::Same) {
                match runs.last_mut() {
                    Some(p) if p.0 + p.1 == r.begin => p.1 += r.length,
                    _ => runs.push((r.begin, r.length)),
                }
            }
            Ok::<_, String>((u64::from(rep.data_block_size) * 512, runs))
        })();
        let released = self.dm.message(pool, "release_metadata_snap");
        if released.is_ok() {
            self.store.mark(&marker, false)?;
        }
        let r = r?;
        released?;
        Ok(r)
    }

    fn snapshot_ranges(&mut self, base: Option<&str>, target: &str) -> Result<Ranges, Error> {
        let unknown = |n: &str| Error::NotFound(format!("snapshot {} not found", crate::table::bounded(n)));
        let (dc, t) = self.snapshot(target).ok_or_else(|| unknown(target))?;
        let left = match base {
            Some(b) => {
                let (bdc, bv) = self.snapshot(b).ok_or_else(|| unknown(b))?;
                if bdc.name != dc.name || bv.origin.is_none() || bv.origin != t.origin {
                    return Err(Error::Invalid(format!(
                        "snapshots {} and {} are not of the same volume",
                        crate::table::bounded(b),
                        crate::table::bounded(target)
                    )));
                }
                Some(bv.dev_id)
            }
            None => None,
        };
        let (block_bytes, runs) = self.thin_ranges(&dc.pool().name.clone(), left, t.dev_id)?;
        Ok(Ranges {
            capacity: t.size_bytes,
            block_bytes,
            runs,
        })
    }
}

/// The tuples of `r` from byte `start`, one at a time: a pool block each, or
/// (`variable`) a run of blocks each. Made as they are sent, so a stream's
/// memory is one message, whatever the volume maps.
fn tuples(r: &Ranges, start: u64, variable: bool) -> impl Iterator<Item = BlockMetadata> + '_ {
    let bytes = r.block_bytes;
    r.runs
        .iter()
        .map(move |&(first, n)| (first * bytes, ((first + n) * bytes).min(r.capacity)))
        .filter(move |&(from, to)| to > start && from < to)
        .flat_map(move |(from, to)| {
            // whole blocks: from the first that ends after `start`
            let first = if variable {
                from
            } else {
                from.max(start - start % bytes)
            };
            let step = if variable { to - from } else { bytes };
            (first..to).step_by(step as usize).map(move |b| BlockMetadata {
                byte_offset: b as i64,
                size_bytes: (step.min(to - b)) as i64,
            })
        })
}

/// The next message: at most `per` tuples.
fn next_message(it: &mut impl Iterator<Item = BlockMetadata>, per: usize) -> Vec<BlockMetadata> {
    it.take(per).collect()
}

pub(super) struct Meta {
    shared: Shared,
    variable: bool,
}

pub(super) fn server(shared: Shared, variable: bool) -> SnapshotMetadataServer<Meta> {
    SnapshotMetadataServer::new(Meta { shared, variable })
}

/// CSI's Identity service: the sidecar that fronts SnapshotMetadata for
/// backup applications (external-snapshot-metadata) asks it on the same
/// socket, and goes on only if SNAPSHOT_METADATA_SERVICE is among the
/// capabilities.
pub(super) struct Identity {
    pub name: String,
}

pub(super) fn identity(name: String) -> IdentityServer<Identity> {
    IdentityServer::new(Identity { name })
}

#[tonic::async_trait]
impl csi::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _r: Request<csi::GetPluginInfoRequest>,
    ) -> Result<Response<csi::GetPluginInfoResponse>, Status> {
        Ok(Response::new(csi::GetPluginInfoResponse {
            name: self.name.clone(),
            vendor_version: env!("CARGO_PKG_VERSION").to_string(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _r: Request<csi::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<csi::GetPluginCapabilitiesResponse>, Status> {
        use csi::plugin_capability::{service::Type, Service, Type as Cap};
        Ok(Response::new(csi::GetPluginCapabilitiesResponse {
            capabilities: vec![csi::PluginCapability {
                r#type: Some(Cap::Service(Service {
                    r#type: Type::SnapshotMetadataService as i32,
                })),
            }],
        }))
    }

    async fn probe(&self, _r: Request<csi::ProbeRequest>) -> Result<Response<csi::ProbeResponse>, Status> {
        Ok(Response::new(csi::ProbeResponse { ready: Some(true) }))
    }
}

fn check_request(start: i64, max_results: i32) -> Result<usize, Status> {
    if start < 0 {
        return Err(Status::invalid_argument(format!(
            "starting_offset {start}: negative"
        )));
    }
    if max_results < 0 {
        return Err(Status::invalid_argument(format!(
            "max_results {max_results}: negative"
        )));
    }
    Ok(match max_results {
        0 => DEFAULT_RESULTS,
        n => (n as usize).min(MAX_RESULTS),
    })
}

impl Meta {
    async fn ranges(&self, base: Option<String>, target: String, start: i64) -> Result<Ranges, Status> {
        if target.is_empty() || base.as_deref() == Some("") {
            return Err(Status::invalid_argument("a snapshot id is empty"));
        }
        let r = self
            .shared
            .with(move |l| l.snapshot_ranges(base.as_deref(), &target))
            .await?;
        if start as u64 >= r.capacity {
            return Err(Status::out_of_range(format!(
                "starting_offset {start}: at or past the end of the snapshot ({} bytes)",
                r.capacity
            )));
        }
        Ok(r)
    }

    fn kind(&self) -> i32 {
        if self.variable {
            BlockMetadataType::VariableLength as i32
        } else {
            BlockMetadataType::FixedLength as i32
        }
    }
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

/// Send each message of tuples as `make` wraps it.
fn stream<T: Send + 'static>(
    r: Ranges,
    start: u64,
    per: usize,
    variable: bool,
    make: impl Fn(i64, Vec<BlockMetadata>) -> T + Send + 'static,
) -> Stream<T> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(async move {
        let cap = r.capacity as i64;
        let mut it = tuples(&r, start, variable);
        let mut first = true;
        loop {
            let m = next_message(&mut it, per);
            // at least one message, so the client learns the capacity and the kind
            if m.is_empty() && !first {
                return;
            }
            first = false;
            let last = m.len() < per;
            if tx.send(Ok(make(cap, m))).await.is_err() || last {
                return;
            }
        }
    });
    ReceiverStream::new(rx)
}

#[tonic::async_trait]
impl SnapshotMetadata for Meta {
    type GetMetadataAllocatedStream = Stream<csi::GetMetadataAllocatedResponse>;
    type GetMetadataDeltaStream = Stream<csi::GetMetadataDeltaResponse>;

    async fn get_metadata_allocated(
        &self,
        r: Request<csi::GetMetadataAllocatedRequest>,
    ) -> Result<Response<Self::GetMetadataAllocatedStream>, Status> {
        let r = r.into_inner();
        let per = check_request(r.starting_offset, r.max_results)?;
        let ranges = self.ranges(None, r.snapshot_id, r.starting_offset).await?;
        let kind = self.kind();
        Ok(Response::new(stream(
            ranges,
            r.starting_offset as u64,
            per,
            self.variable,
            move |cap, block_metadata| csi::GetMetadataAllocatedResponse {
                block_metadata_type: kind,
                volume_capacity_bytes: cap,
                block_metadata,
            },
        )))
    }

    async fn get_metadata_delta(
        &self,
        r: Request<csi::GetMetadataDeltaRequest>,
    ) -> Result<Response<Self::GetMetadataDeltaStream>, Status> {
        let r = r.into_inner();
        let per = check_request(r.starting_offset, r.max_results)?;
        let ranges = self
            .ranges(Some(r.base_snapshot_id), r.target_snapshot_id, r.starting_offset)
            .await?;
        let kind = self.kind();
        Ok(Response::new(stream(
            ranges,
            r.starting_offset as u64,
            per,
            self.variable,
            move |cap, block_metadata| csi::GetMetadataDeltaResponse {
                block_metadata_type: kind,
                volume_capacity_bytes: cap,
                block_metadata,
            },
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The messages a stream sends (as `stream` cuts them).
    fn messages(r: &Ranges, start: u64, per: usize, variable: bool) -> Vec<Vec<BlockMetadata>> {
        let mut it = tuples(r, start, variable);
        let mut out = vec![next_message(&mut it, per)];
        while out.last().is_some_and(|m| m.len() == per) {
            let m = next_message(&mut it, per);
            if m.is_empty() {
                break;
            }
            out.push(m);
        }
        out
    }

    fn offsets(m: &[Vec<BlockMetadata>]) -> Vec<(i64, i64)> {
        m.iter()
            .flatten()
            .map(|b| (b.byte_offset, b.size_bytes))
            .collect()
    }

    #[test]
    fn tuples_start_where_asked_end_at_the_capacity_and_respect_max_results() {
        let r = Ranges {
            capacity: 10 * 64,
            block_bytes: 64,
            runs: vec![(0, 2), (5, 10)],
        };
        let all = messages(&r, 0, 2, false);
        assert_eq!(all.iter().map(Vec::len).collect::<Vec<_>>(), vec![2, 2, 2, 1]);
        assert_eq!(
            offsets(&all),
            vec![
                (0, 64),
                (64, 64),
                (320, 64),
                (384, 64),
                (448, 64),
                (512, 64),
                (576, 64)
            ]
        );
        // from byte 100: block 1 still ends after it
        assert_eq!(offsets(&messages(&r, 100, 10, false))[0], (64, 64));
        assert_eq!(offsets(&messages(&r, 0, 10, true)), vec![(0, 128), (320, 320)]);
        assert_eq!(offsets(&messages(&r, 200, 10, true)), vec![(320, 320)]);
        let none = messages(&r, 640, 10, true);
        assert_eq!(none.len(), 1);
        assert!(none[0].is_empty());
    }
}
