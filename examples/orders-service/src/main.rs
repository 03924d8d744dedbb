//! Runs the order service on 127.0.0.1:3000 with records in `orders-idem.db`.

use std::sync::Arc;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let store: idem::SharedStore = Arc::new(idem::SqliteStore::open("orders-idem.db")?);
    // Expired records stay in the store until deleted; delete them once a minute.
    tokio::spawn(idem::purge::purge_loop(
        store.clone(),
        Arc::new(idem::SystemClock),
        Duration::from_secs(60),
    ));
    let app = orders_service::app(store, orders_service::Orders::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
    eprintln!("orders service on http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}
