//! lvmd's servers: TopoLVM's LVService and VGService on lvmd's unix socket
//! ([`super::service`]) and, where asked, CSI SnapshotMetadata on its own
//! ([`super::snapmeta`]), served until SIGINT or SIGTERM.

use super::pb::lv_service_server::LvServiceServer;
use super::pb::vg_service_server::VgServiceServer;
use super::service::Shared;
use super::{Lvmd, Options};
use tokio_stream::wrappers::UnixListenerStream;

/// Listen on PATH (a stale socket file is replaced; anything else there is
/// an error).
fn listen(path: &std::path::Path) -> Result<tokio::net::UnixListener, String> {
    use std::os::unix::fs::FileTypeExt;
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(format!("{}: exists and is not a socket", path.display()));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!("{}: another server answers there", path.display()));
        }
        std::fs::remove_file(path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    tokio::net::UnixListener::bind(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Serve until SIGINT or SIGTERM.
pub fn run(opts: Options) -> Result<(), String> {
    let cfg = super::Config::load(&opts.config)?;
    // lvmd's default
    let socket = cfg
        .socket_name
        .clone()
        .unwrap_or_else(|| std::path::PathBuf::from("/run/topolvm/lvmd.sock"));
    if let Some(n) = opts.test_exit_after_steps {
        tracing::warn!("lvmd: for tests: exiting after {n} steps (--test-exit-after-steps)");
    }
    if let Some(n) = opts.test_page_runs {
        tracing::warn!("lvmd: for tests: SnapshotMetadata reads pages of {n} runs (--test-page-runs)");
    }
    let mut lvmd = Lvmd::new(cfg, &opts)?;
    lvmd.recover()?;
    let shared = Shared::new(lvmd);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("lvmd: starting its runtime: {e}"))?;
    rt.block_on(async move {
        let lis = listen(&socket)?;
        tracing::info!("lvmd: serving TopoLVM's lvmd protocol on {}", socket.display());
        let main = tonic::transport::Server::builder()
            .add_service(LvServiceServer::new(shared.clone()))
            .add_service(VgServiceServer::new(shared.clone()))
            .serve_with_incoming_shutdown(UnixListenerStream::new(lis), stop());
        match &opts.snapshot_metadata {
            Some(path) => {
                let lis = listen(path)?;
                tracing::info!("lvmd: serving CSI SnapshotMetadata on {}", path.display());
                let sm = tonic::transport::Server::builder()
                    .add_service(super::snapmeta::identity(opts.csi_driver_name.clone()))
                    .add_service(super::snapmeta::server(
                        shared.clone(),
                        opts.variable_length,
                        opts.page_runs(),
                    ))
                    .serve_with_incoming_shutdown(UnixListenerStream::new(lis), stop());
                let (a, b) = tokio::join!(main, sm);
                a.and(b).map_err(|e| format!("lvmd: {e}"))
            }
            None => main.await.map_err(|e| format!("lvmd: {e}")),
        }
    })
}

async fn stop() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}
