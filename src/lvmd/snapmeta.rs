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
use crate::thin::delta::{changed_runs, mapped_runs, DeltaOptions, Side};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

/// Tuples per message when the request leaves it to us.
const DEFAULT_RESULTS: usize = 1024;
/// The most tuples one message carries, whatever is asked (gRPC's 4 MiB
/// message limit holds ~200 K of them).
const MAX_RESULTS: usize = 65536;

/// Runs of blocks one read of the pool's metadata gives at most: a stream's
/// memory is one page of runs (16 bytes each) and one message, however many
/// the volume has; the next page is read from where the last one ended.
pub(super) const PAGE_RUNS: usize = 65536;

/// One page of a volume's blocks as runs, in order, not overlapping.
struct Ranges {
    capacity: u64,
    block_bytes: u64,
    /// (first block, blocks)
    runs: Vec<(u64, u64)>,
}

impl Ranges {
    /// The byte the next page starts at (None: this was the last).
    fn next_page(&self, max_runs: usize) -> Option<u64> {
        match self.runs.last() {
            Some(&(first, n)) if self.runs.len() >= max_runs => Some((first + n) * self.block_bytes),
            _ => None,
        }
    }
}

/// Which ranges a request asks for: base (None: what the target maps) and
/// target snapshot ids.
#[derive(Clone)]
struct Ask {
    base: Option<String>,
    target: String,
}

/// The marker lvmd keeps while it holds POOL's metadata snapshot.
pub(super) fn metadata_snap_marker(pool: &str) -> String {
    format!(".metadata-snap.{pool}.held")
}

impl Lvmd {
    /// The runs thin device `right` maps, or (with `left`) the runs where
    /// `left` and `right` map differently, from the block holding byte `from`,
    /// at most `max_runs`, from a metadata snapshot of `pool`, with the pool's
    /// block size in bytes.
    fn thin_ranges(
        &mut self,
        pool: &str,
        (left, right): (Option<u64>, u64),
        from: u64,
        max_runs: usize,
    ) -> Result<(u64, Vec<(u64, u64)>), Error> {
        let (meta, block_sectors) = self.dm.pool_table(pool)?;
        let path = std::path::Path::new(&meta);
        if !path.is_absolute() || !path.exists() {
            return Err(Error::Unimplemented(format!(
                "{pool}: its metadata device {meta} is not a file or block device lvmd can read"
            )));
        }
        if block_sectors == 0 {
            return Err(Error::Invalid(format!(
                "{pool}: a data block size of 0 in its table"
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
            let first = from / (block_sectors * 512);
            // what the two snapshots share is not read
            let (block, runs) = match left {
                Some(_) => changed_runs(&mut tm, &o, first, max_runs),
                None => mapped_runs(&mut tm, &o, first, max_runs),
            }
            .map_err(reading)?;
            if u64::from(block) != block_sectors {
                return Err(format!(
                    "{pool}: its metadata's data block size ({block} sectors) is not its table's ({block_sectors})"
                ));
            }
            Ok::<_, String>((block_sectors * 512, runs))
        })();
        let released = self.dm.message(pool, "release_metadata_snap");
        if released.is_ok() {
            self.store.mark(&marker, false)?;
        }
        let r = r?;
        released?;
        Ok(r)
    }

    /// A page of what `ask` asks for, from byte `from`.
    fn snapshot_ranges(&mut self, ask: &Ask, from: u64) -> Result<Ranges, Error> {
        let unknown = |n: &str| Error::NotFound(format!("snapshot {} not found", crate::table::bounded(n)));
        let target = ask.target.as_str();
        let (dc, t) = self.snapshot(target).ok_or_else(|| unknown(target))?;
        let left = match ask.base.as_deref() {
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
        let capacity = t.size_bytes;
        let (block_bytes, runs) =
            self.thin_ranges(&dc.pool().name.clone(), (left, t.dev_id), from, self.page_runs)?;
        Ok(Ranges {
            capacity,
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

pub(super) struct Meta {
    shared: Shared,
    variable: bool,
    /// The runs of a page ([`PAGE_RUNS`], or the test option's).
    page_runs: usize,
}

pub(super) fn server(shared: Shared, variable: bool, page_runs: usize) -> SnapshotMetadataServer<Meta> {
    SnapshotMetadataServer::new(Meta {
        shared,
        variable,
        page_runs,
    })
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
    /// The first page of what `ask` asks for from byte `start`, checked.
    async fn first_page(&self, ask: &Ask, start: i64) -> Result<Ranges, Status> {
        if ask.target.is_empty() || ask.base.as_deref() == Some("") {
            return Err(Status::invalid_argument("a snapshot id is empty"));
        }
        let r = read_page(self.shared.clone(), ask.clone(), start as u64).await?;
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

    /// The stream of `ask` from byte `start`, `first` its first page: each
    /// message as `make` wraps it.
    fn stream<T: Send + 'static>(
        &self,
        ask: Ask,
        first: Ranges,
        start: u64,
        per: usize,
        make: impl Fn(i64, Vec<BlockMetadata>) -> T + Send + 'static,
    ) -> Stream<T> {
        let shared = self.shared.clone();
        let pages = move |from: u64| read_page(shared.clone(), ask.clone(), from);
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(send_pages(
            first,
            (pages, self.page_runs),
            start,
            per,
            self.variable,
            move |m| {
                let tx = tx.clone();
                let m = m.map(|(cap, tuples)| make(cap, tuples));
                async move { tx.send(m).await.is_ok() }
            },
        ));
        ReceiverStream::new(rx)
    }
}

type Stream<T> = ReceiverStream<Result<T, Status>>;

/// A page of what `ask` asks for, from byte `from`, read on lvmd's side.
async fn read_page(shared: Shared, ask: Ask, from: u64) -> Result<Ranges, Status> {
    shared.with(move |l| l.snapshot_ranges(&ask, from)).await
}

/// Cut the pages of a volume's runs, `first` and those `pages` gives from a
/// byte on, into messages of `per` tuples from byte `start`, and `send` each
/// (it answers false once the client has gone); at least one message, so the
/// client learns the capacity and the kind. A page that fails ends the stream
/// with its error. The memory is one page and one message. A page of
/// `page_runs` runs is followed by another.
async fn send_pages<P, F, S, SF>(
    first: Ranges,
    (mut pages, page_runs): (P, usize),
    start: u64,
    per: usize,
    variable: bool,
    send: S,
) where
    P: FnMut(u64) -> F,
    F: std::future::Future<Output = Result<Ranges, Status>>,
    S: Fn(Result<(i64, Vec<BlockMetadata>), Status>) -> SF,
    SF: std::future::Future<Output = bool>,
{
    let cap = first.capacity as i64;
    let mut page = first;
    let mut msg = Vec::with_capacity(per.min(DEFAULT_RESULTS));
    let mut sent = false;
    loop {
        {
            let mut it = tuples(&page, start, variable);
            loop {
                msg.extend(it.by_ref().take(per - msg.len()));
                if msg.len() < per {
                    break;
                }
                sent = true;
                if !send(Ok((cap, std::mem::take(&mut msg)))).await {
                    return;
                }
            }
        }
        let Some(from) = page.next_page(page_runs) else {
            break;
        };
        page = match pages(from).await {
            Ok(p) => p,
            Err(e) => {
                send(Err(e)).await;
                return;
            }
        };
    }
    if !msg.is_empty() || !sent {
        send(Ok((cap, msg))).await;
    }
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
        let ask = Ask {
            base: None,
            target: r.snapshot_id,
        };
        let first = self.first_page(&ask, r.starting_offset).await?;
        let kind = self.kind();
        Ok(Response::new(self.stream(
            ask,
            first,
            r.starting_offset as u64,
            per,
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
        let ask = Ask {
            base: Some(r.base_snapshot_id),
            target: r.target_snapshot_id,
        };
        let first = self.first_page(&ask, r.starting_offset).await?;
        let kind = self.kind();
        Ok(Response::new(self.stream(
            ask,
            first,
            r.starting_offset as u64,
            per,
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

    /// What a stream sends for the runs of `r` in pages of `page_runs`, from
    /// byte `start`, `per` tuples a message, until a page that starts at or
    /// past byte `fail_at` fails.
    fn paged(
        r: &Ranges,
        page_runs: usize,
        start: u64,
        per: usize,
        variable: bool,
        fail_at: u64,
    ) -> Vec<Result<Vec<BlockMetadata>, String>> {
        // as the pool gives them: the runs from the block holding `from`, the
        // first one cut there
        let page = |from: u64| {
            let at = from / r.block_bytes;
            Ranges {
                runs: r
                    .runs
                    .iter()
                    .filter(|&&(b, n)| b + n > at)
                    .map(|&(b, n)| (b.max(at), b + n - b.max(at)))
                    .take(page_runs)
                    .collect(),
                ..*r
            }
        };
        let first = page(start);
        let out = std::sync::Mutex::new(Vec::new());
        let send = |m: Result<(i64, Vec<BlockMetadata>), Status>| {
            out.lock()
                .expect("lock")
                .push(m.map(|m| m.1).map_err(|e| e.message().to_string()));
            async { true }
        };
        let pages = |from: u64| {
            let p = if from >= fail_at {
                Err(Status::internal(format!("page at {from}")))
            } else {
                Ok(page(from))
            };
            async move { p }
        };
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(send_pages(first, (pages, page_runs), start, per, variable, send));
        out.into_inner().expect("lock")
    }

    /// The messages a stream sends for `r` in one page.
    fn messages(r: &Ranges, start: u64, per: usize, variable: bool) -> Vec<Vec<BlockMetadata>> {
        let all = paged(r, usize::MAX, start, per, variable, u64::MAX);
        all.into_iter().map(|m| m.expect("no page fails")).collect()
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

    #[test]
    fn pages_of_runs_make_the_same_messages_as_one_and_a_failed_page_ends_the_stream() {
        let r = Ranges {
            capacity: 200 * 64,
            block_bytes: 64,
            runs: (0..40).map(|i| (i * 5, 1 + i % 3)).collect(),
        };
        for variable in [false, true] {
            for start in [0, 64, 100, 5 * 64, 199 * 64] {
                for per in [1, 2, 3, 7, 100] {
                    let whole = offsets(&messages(&r, start, per, variable));
                    for page_runs in [1, 2, 3, 39, 40] {
                        let got = paged(&r, page_runs, start, per, variable, u64::MAX);
                        let got: Vec<Vec<BlockMetadata>> =
                            got.into_iter().map(|m| m.expect("no page fails")).collect();
                        assert_eq!(
                            offsets(&got),
                            whole,
                            "variable {variable} start {start} per {per} pages of {page_runs}"
                        );
                        // full messages but the last, and no empty one unless it is the only one
                        let n = got.len();
                        assert!(got[..n - 1].iter().all(|m| m.len() == per));
                        assert!(n == 1 || !got[n - 1].is_empty());
                    }
                }
            }
        }
        // pages of 4 runs start at blocks 0, 16, 37 and 58; the one from block
        // 58 fails: the 12 runs before it are sent (4 messages of 3), then the error
        let got = paged(&r, 4, 0, 3, true, 50 * 64);
        let (last, sent) = got.split_last().expect("messages");
        assert_eq!(last.as_ref().err().map(String::as_str), Some("page at 3712"));
        let sent: Vec<Vec<BlockMetadata>> = sent.iter().map(|m| m.clone().expect("sent")).collect();
        assert_eq!(sent.len(), 4);
        let before = offsets(&messages(&r, 0, 3, true))[..12].to_vec();
        assert_eq!(offsets(&sent), before);
    }
}
