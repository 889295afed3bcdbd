// UnaryCalls (unary_calls.h): a bounded pool for the Stage service's unary calls.
#include "unary_calls.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <system_error>
#include <thread>

namespace dgr {

namespace {
constexpr auto IDLE_EXIT = std::chrono::seconds(30);   // a thread with nothing to run for this long exits
}

grpc::ServerUnaryReactor * UnaryCalls::start(grpc::CallbackServerContext * ctx, const std::string & member,
                                             const std::string & who, Body body) {
    grpc::ServerUnaryReactor * r = ctx->DefaultReactor();
    std::string refusal;
    bool spawn = false;
    {
        std::lock_guard<std::mutex> g(mu_);
        size_t & mine = per_member_[member];
        if (stopping_) {
            refusal = who + " is shutting down";
        } else if (b_.per_member && mine >= b_.per_member) {
            refusal = who + ": this member has " + std::to_string(mine) + " calls running or waiting here, the most " +
                      "one member may (--max-rpc-per-member " + std::to_string(b_.per_member) +
                      "): retry when one of them has finished";
        } else if (q_.size() >= b_.queued + waiting_threads_) {
            refusal = who + " is busy: " + std::to_string(running_) + " calls running and " + std::to_string(q_.size()) +
                      " waiting (--max-rpc-threads " + std::to_string(b_.threads) + "): retry shortly";
        }
        if (!refusal.empty()) {
            if (mine == 0) per_member_.erase(member);
            ++refused_;
        } else {
            ++mine;
            q_.push_back(Call{ctx, r, member, std::move(body)});
            // a thread for every call no idle thread will take (an idle thread already woken for an earlier
            // call still counts as waiting until it runs, so compare the queue with them, never test for 0)
            if (q_.size() > waiting_threads_ && threads_ < b_.threads) {
                ++threads_;
                spawn = true;
            }
        }
    }
    if (!refusal.empty()) {
        r->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, refusal));
        return r;
    }
    if (spawn) {
        try {
            std::thread([this] { loop(); }).detach();
        } catch (const std::system_error &) {        // no thread to be had: the ones there take the call
            std::deque<Call> orphans;                // ... unless there are none: refuse what waits
            {
                std::lock_guard<std::mutex> g(mu_);
                if (--threads_ == 0) {
                    orphans.swap(q_);
                    for (Call & c : orphans) done(c.member);
                }
            }
            for (Call & c : orphans) {
                c.reactor->Finish(grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, who + " cannot start a thread: retry shortly"));
            }
        }
    } else {
        work_.notify_one();
    }
    return r;
}

void UnaryCalls::loop() {
    std::unique_lock<std::mutex> lk(mu_);
    while (true) {
        ++waiting_threads_;
        bool woke = work_.wait_for(lk, IDLE_EXIT, [&] { return !q_.empty() || stopping_; });
        --waiting_threads_;
        if (q_.empty() && (stopping_ || !woke)) break;
        Call c = std::move(q_.front());
        q_.pop_front();
        ++running_;
        lk.unlock();
        grpc::Status st;
        if (c.ctx->IsCancelled()) {                  // the caller gave up while it waited
            st = grpc::Status(grpc::StatusCode::CANCELLED, "the caller went away");
        } else {
            try {
                st = c.body();
            } catch (const std::exception & e) {
                st = grpc::Status(grpc::StatusCode::INTERNAL, std::string("the call failed: ") + e.what());
            } catch (...) {
                st = grpc::Status(grpc::StatusCode::INTERNAL, "the call failed (unknown exception)");
            }
        }
        c.body = nullptr;                            // what the body held goes before the call ends
        c.reactor->Finish(st);
        lk.lock();
        --running_;
        done(c.member);
    }
    --threads_;
    if (threads_ == 0) idle_.notify_all();
}

void UnaryCalls::done(const std::string & member) {
    auto it = per_member_.find(member);
    if (it != per_member_.end() && --it->second == 0) per_member_.erase(it);
}

UnaryCalls::Counts UnaryCalls::counts() const {
    std::lock_guard<std::mutex> g(mu_);
    return Counts{running_, q_.size(), threads_, per_member_.size(), refused_};
}

UnaryCalls::~UnaryCalls() {
    std::unique_lock<std::mutex> lk(mu_);
    stopping_ = true;
    work_.notify_all();
    idle_.wait(lk, [&] { return threads_ == 0; });
}

}  // namespace dgr
